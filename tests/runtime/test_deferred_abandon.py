"""``QemuDeferredMemory.abandon`` against its ``write``: who gets the frozen VMM.

A resume in place abandons a deferred pause's memory write; the write commits (manifest,
marker) or, failed, ends the VMM. Exactly one of them wins (``_WriteGate``), and the loser
leaves the VMM alone or waits. No VMM here: the copy is a stand-in thread
(``_write_pending_memory`` replaced) and the VM an object that counts ``stop``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from aenv.runtime import qemu_snapshot
from aenv.runtime.base import MemoryWriteAbandoned, SnapshotError
from aenv.storage import snapshots as snap


class FrozenVM:
    vm_id = "vm-under-test"
    pid = 4242

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.stops = 0
        self.given: list[Path] = []
        self.jail = self

    def give(self, path: Path, mode: int = 0o600) -> None:
        self.given.append(path)

    async def stop(self, timeout: float = 5.0) -> None:
        self.stops += 1


def pending_snapshot(tmp_path: Path, vm: FrozenVM) -> Path:
    directory = tmp_path / "paused"
    directory.mkdir()
    snap.write_pending(directory, snap.PendingMemory(vm.workdir, True, {"slot": 1}))
    return directory


def deferred(tmp_path: Path) -> tuple[qemu_snapshot.QemuDeferredMemory, FrozenVM, Path]:
    vm = FrozenVM(tmp_path / "vm")
    vm.workdir.mkdir()
    directory = pending_snapshot(tmp_path, vm)
    return qemu_snapshot.QemuDeferredMemory(vm, directory, 4), vm, directory  # type: ignore[arg-type]


def copying(chunks: list[int], release: threading.Event | None = None,
            fail: bool = False):
    """A stand-in copy: checks the gate before each of many chunks (as ``_write_changed``
    does), then closes it and commits, or fails."""

    def write(pid, workdir, directory, max_chain, gate):
        for _ in range(500):
            gate.check()
            chunks.append(1)
            time.sleep(0.002)
        if release is not None:
            release.wait(5)
        if fail:
            raise OSError("the disk is full")
        if not gate.close():
            raise qemu_snapshot._Abandoned()
        (directory / snap.MEMORY_PENDING).unlink()
        return {"memory_copy": 0.0}

    return write


async def test_an_abandon_stops_the_copy_and_leaves_the_vmm_alone(tmp_path, monkeypatch) -> None:
    d, vm, directory = deferred(tmp_path)
    chunks: list[int] = []
    monkeypatch.setattr(qemu_snapshot, "_write_pending_memory", copying(chunks))
    writing = asyncio.create_task(d.write())
    await asyncio.sleep(0.05)
    assert await d.abandon()
    copied = len(chunks)
    assert 0 < copied < 500, "the abandon did not stop the copy"
    with pytest.raises(MemoryWriteAbandoned):
        await writing
    assert len(chunks) == copied, "the copy went on after the abandon returned"
    assert vm.stops == 0
    assert snap.memory_abandoned(directory) and not snap.memory_pending(directory)


async def test_an_abandon_before_the_write_starts_means_it_never_does(tmp_path) -> None:
    d, vm, directory = deferred(tmp_path)
    assert await d.abandon()
    with pytest.raises(MemoryWriteAbandoned):
        await d.write()
    assert vm.stops == 0 and snap.memory_abandoned(directory)


async def test_a_write_that_closed_its_gate_first_wins(tmp_path, monkeypatch) -> None:
    d, vm, directory = deferred(tmp_path)
    release = threading.Event()
    chunks: list[int] = []
    monkeypatch.setattr(qemu_snapshot, "_write_pending_memory", copying(chunks, release))
    writing = asyncio.create_task(d.write())
    while len(chunks) < 500:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # blocked after the copy, before its gate closes
    release.set()
    while not d._gate.closed:
        await asyncio.sleep(0.001)
    assert not await d.abandon()
    assert await writing == {"memory_copy": 0.0, "vmm_stop": pytest.approx(0, abs=1)}
    assert vm.stops == 1 and not snap.memory_pending(directory)
    assert not snap.memory_abandoned(directory)


async def test_a_failed_copy_abandoned_meanwhile_does_not_end_the_vmm(tmp_path,
                                                                     monkeypatch) -> None:
    """The copy fails, but the resume's abandon came first: the VMM is the resume's."""
    d, vm, _ = deferred(tmp_path)
    release = threading.Event()
    chunks: list[int] = []
    monkeypatch.setattr(qemu_snapshot, "_write_pending_memory",
                        copying(chunks, release, fail=True))
    writing = asyncio.create_task(d.write())
    while len(chunks) < 500:
        await asyncio.sleep(0.01)
    abandoning = asyncio.create_task(d.abandon())
    await asyncio.sleep(0.05)
    assert not abandoning.done(), "the abandon did not wait for the copy's thread"
    release.set()
    assert await abandoning
    with pytest.raises(MemoryWriteAbandoned):
        await writing
    assert vm.stops == 0


async def test_a_failed_copy_not_abandoned_ends_the_vmm(tmp_path, monkeypatch) -> None:
    d, vm, directory = deferred(tmp_path)
    monkeypatch.setattr(qemu_snapshot, "_write_pending_memory", copying([], fail=True))
    with pytest.raises(SnapshotError, match="not written"):
        await d.write()
    assert vm.stops == 1 and snap.memory_pending(directory)
    assert not await d.abandon(), "abandoned a write that already ended its VMM"


async def test_the_abandon_is_redone_after_a_restart_cut_it(tmp_path) -> None:
    """The rename is the abandon's commit; its other steps are idempotent."""
    _, vm, directory = deferred(tmp_path)
    snap.abandon_pending(directory)
    (directory / snap.MEMORY).write_bytes(b"an interrupted copy")
    again = qemu_snapshot.QemuDeferredMemory(vm, directory, 4)  # type: ignore[arg-type]
    assert await again.abandon()
    assert snap.memory_abandoned(directory) and not (directory / snap.MEMORY).exists()
