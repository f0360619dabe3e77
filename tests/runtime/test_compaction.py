"""Background compaction of snapshot drive chains (``aenv.runtime.compaction`` and the qemu
driver's ``prepare_compaction``), on real qcow2 chains and no VM: the guest's disk reads
the same before, during and after, a server that dies at any step loses nothing, and
garbage collection frees the old chain only once it is released.

A "snapshot" here is a directory in the ``aenv.storage.snapshots`` layout whose drive is a
qcow2 file on the previous snapshot's, as running captures leave them; each generation
writes its own pattern into its own 64 KiB of the disk.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from aenv.runtime import qemu_snapshot
from aenv.runtime.compaction import Compactor
from aenv.runtime.qemu import QemuRuntime
from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap

MEM = 4 * snap.PAGE_SIZE
DISK = 4 << 20
CHUNK = 64 << 10
MAX_CHAIN = 2


def _io(image: Path, command: str) -> str:
    out = subprocess.run(["qemu-io", "-f", "qcow2", "-r" if "read" in command else "-n",
                          "-c", command, str(image)], capture_output=True, text=True,
                         check=True)
    assert "Pattern verification failed" not in out.stdout, out.stdout
    return out.stdout


def _snapshot(root: Path, name: str, parent: Path | None, base: Path,
              chain: list[Path]) -> Path:
    """Snapshot ``name`` whose drive sits on ``parent``'s drive file (or the base image),
    with generation ``len(chain)``'s pattern written; ``chain``: the recorded chain."""
    d = root / name
    d.mkdir(parents=True)
    (d / snap.DEVICE_STATE).write_bytes(b"state")
    (d / snap.MEMORY).write_bytes(b"\0" * MEM)
    drive = d / "rootfs.qcow2"
    backing, fmt = (parent / "rootfs.qcow2", "qcow2") if parent else (base, "raw")
    snap.create_overlay(drive, backing, fmt, DISK)
    gen = len(chain)
    _io(drive, f"write -P {0x11 + gen} {gen * CHUNK} {CHUNK}")
    m = snap.Manifest(
        driver=qemu_snapshot.DRIVER, vm={}, memory_size=MEM,
        layers=(snap.MemoryLayer(d, "full", 1),),
        drives=(snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2",
                                chain=tuple(chain), root=base, root_format="raw"),))
    (d / snap.MANIFEST).write_text(json.dumps(m.to_json(d)))
    return d


def _chain(tmp_path: Path, depth: int) -> tuple[Path, list[Path]]:
    """The snapshots root and ``depth`` snapshots s0..s{depth-1}, each on the last."""
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * DISK)
    root = tmp_path / "snapshots"
    dirs: list[Path] = []
    for i in range(depth):
        chain = [d / "rootfs.qcow2" for d in reversed(dirs)]
        dirs.append(_snapshot(root, f"s{i}", dirs[-1] if dirs else None, base, chain))
    return root, dirs


def _reads_every_generation(directory: Path, generations: int) -> None:
    for gen in range(generations):
        _io(directory / "rootfs.qcow2", f"read -P {0x11 + gen} {gen * CHUNK} {CHUNK}")


def _backing_chain_depth(directory: Path) -> int:
    return len(snapshot_store.backing_chain(directory / "rootfs.qcow2")) - 1  # minus base


def test_a_short_chain_needs_no_compaction(tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, MAX_CHAIN)
    assert qemu_snapshot.prepare_compaction(dirs[-1], MAX_CHAIN) is None


def test_a_compaction_flattens_onto_the_root_and_the_disk_reads_the_same(
        tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None
    # Prepared only: the snapshot is untouched, its flattened copy waits beside it.
    assert _backing_chain_depth(top) == 3
    assert (top / ".rootfs.qcow2.compacting").is_file()
    assert job.install()
    assert _backing_chain_depth(top) == 0
    assert not (top / ".rootfs.qcow2.compacting").exists()
    _reads_every_generation(top, 4)
    # Installed, not released: the manifest still names the old chain (kept from GC).
    assert len(snap.read_manifest(top).drive("rootfs").chain) == 3
    job.release()
    assert snap.read_manifest(top).drive("rootfs").chain == ()
    _reads_every_generation(top, 4)
    subprocess.run(["qemu-img", "check", "-q", str(top / "rootfs.qcow2")], check=True)


def test_garbage_collection_frees_the_old_chain_only_after_the_release(
        tmp_path: Path) -> None:
    root, dirs = _chain(tmp_path, 4)
    layers = tmp_path / "layers"
    job = qemu_snapshot.prepare_compaction(dirs[-1], MAX_CHAIN)
    assert job is not None and job.install()
    assert snapshot_store.collect(root, layers, ["snapshot:s3"]) == []
    job.release()
    assert sorted(snapshot_store.collect(root, layers, ["snapshot:s3"])) == dirs[:3]
    _reads_every_generation(dirs[-1], 4)


def test_a_server_that_died_while_flattening_leaves_a_snapshot_that_compacts_again(
        tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None  # ... and the server died before installing it
    stale = top / ".rootfs.qcow2.compacting"
    stale.write_bytes(b"half a copy")
    assert snap.read_manifest(top).drive("rootfs").chain  # still the old, whole snapshot
    _reads_every_generation(top, 4)
    again = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert again is not None and again.install()
    again.release()
    assert _backing_chain_depth(top) == 0
    _reads_every_generation(top, 4)


def test_a_server_that_died_between_install_and_release_only_releases(
        tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None and job.install()  # ... and the server died here
    again = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert again is not None
    assert [d.flat for d in again.drives] == [None]  # nothing is flattened twice
    assert again.install()
    again.release()
    assert snap.read_manifest(top).drive("rootfs").chain == ()
    _reads_every_generation(top, 4)


def test_a_snapshot_collected_before_the_install_is_left_alone(tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None
    (top / snap.MANIFEST).unlink()  # what collection removes first... of a whole directory
    assert not job.install()
    assert not (top / ".rootfs.qcow2.compacting").exists()


def test_the_next_capture_reads_its_parents_chain_from_the_headers(tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    recorded = snap.read_manifest(top).drive("rootfs").chain
    base = tmp_path / "base.raw"
    assert qemu_snapshot._chain_between(top / "rootfs.qcow2", base, recorded) == recorded
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None and job.install()
    # Installed, not released: the manifest is longer than the truth; the headers tell.
    assert qemu_snapshot._chain_between(top / "rootfs.qcow2", base, recorded) == ()


async def test_the_compactor_compacts_in_the_background_under_the_lock(
        tmp_path: Path) -> None:
    _, dirs = _chain(tmp_path, 4)
    lock = asyncio.Lock()
    compactor = Compactor(QemuRuntime(max_chain=MAX_CHAIN), lock, release_after_s=0.0)
    try:
        async with lock:  # a capture holds the lock: the compaction waits to install
            compactor.schedule(dirs[-1])
            compactor.schedule(dirs[0])  # short enough: nothing to do
            await asyncio.sleep(0.5)
            assert _backing_chain_depth(dirs[-1]) == 3
        await asyncio.wait_for(compactor.settle(), 60)
    finally:
        await compactor.close()
    assert _backing_chain_depth(dirs[-1]) == 0
    assert snap.read_manifest(dirs[-1]).drive("rootfs").chain == ()
    assert len(compactor.history) == 1
    _reads_every_generation(dirs[-1], 4)


async def test_recovery_at_start_up_finishes_every_interrupted_compaction(
        tmp_path: Path) -> None:
    root, dirs = _chain(tmp_path, 5)
    installed = qemu_snapshot.prepare_compaction(dirs[3], MAX_CHAIN)
    assert installed is not None and installed.install()  # died before the release
    (dirs[4] / ".rootfs.qcow2.compacting").write_bytes(b"died while flattening")
    compactor = Compactor(QemuRuntime(max_chain=MAX_CHAIN), asyncio.Lock(),
                          release_after_s=0.0)
    try:
        assert compactor.recover(root) == 5
        await asyncio.wait_for(compactor.settle(), 60)
    finally:
        await compactor.close()
    for d in dirs[2:]:
        assert snap.read_manifest(d).drive("rootfs").chain == (), d
        assert not (d / ".rootfs.qcow2.compacting").exists()
    _reads_every_generation(dirs[4], 5)


async def test_a_failing_compaction_keeps_the_snapshot_as_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, dirs = _chain(tmp_path, 4)

    def broken(*args: object) -> None:
        raise snap.SnapshotFilesError("qemu-img rebase failed")

    monkeypatch.setattr(snap, "flatten_onto", broken)
    compactor = Compactor(QemuRuntime(max_chain=MAX_CHAIN), asyncio.Lock(),
                          release_after_s=0.0)
    try:
        compactor.schedule(dirs[-1])
        await asyncio.wait_for(compactor.settle(), 60)
    finally:
        await compactor.close()
    assert len(snap.read_manifest(dirs[-1]).drive("rootfs").chain) == 3
    assert not (dirs[-1] / ".rootfs.qcow2.compacting").exists()
    _reads_every_generation(dirs[-1], 4)
