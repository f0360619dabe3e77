"""A pause that answers before its memory is written (``NodeMachines``'s deferred pause):
the sandbox is ``paused`` at once, a resume waits for the write, a kill meanwhile does not
let collection delete the snapshot under it, and a snapshot whose write never finished is
refused with the reason. The machines, store and orchestrator are real; the VM is a stand-in
whose memory write waits for the test (``Deferring``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aenv.orchestrator.errors import NotRestorable
from aenv.orchestrator.node import NodeMachines
from aenv.runtime.base import DeferredMemory, SnapshotInfo
from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap
from tests.orchestrator.test_node_snapshot_safety import SlowVM, node, running_sandbox

__all__ = ["node"]  # the fixture, used by name below


class Deferring(DeferredMemory):
    """Writes nothing until ``go`` is set; then removes the marker as the real one does."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.go = asyncio.Event()
        self.started = False
        self.done = False

    async def write(self) -> dict[str, float]:
        self.started = True
        await self.go.wait()
        (self.directory / snap.MEMORY_PENDING).unlink()
        self.done = True
        return {"memory_copy": 0.0}


class DeferringVM(SlowVM):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, delay=0.0)
        self.deferred: Deferring | None = None

    async def pause_deferred(self, directory: Path, note: dict[str, object] | None = None
                             ) -> tuple[SnapshotInfo, Deferring]:
        info = await self.snapshot(directory, stop=False)
        snap.write_pending(directory, snap.PendingMemory(self.workdir, True, dict(note or {})))
        self.deferred = Deferring(directory)
        return info, self.deferred


def deferring_sandbox(orch, machines: NodeMachines, settings):
    rec, _ = running_sandbox(orch, machines, settings)
    vm = DeferringVM(Path(rec.vm_dir))
    machines._running[rec.id].vm = vm
    return rec, vm


async def test_a_pause_answers_before_its_memory_and_a_resume_waits_for_it(node) -> None:
    orch, machines, settings = node
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    paused = orch.get(rec.id)
    assert paused.state == "paused" and vm.deferred is not None and not vm.deferred.done
    directory = snapshot_store.directory(settings.snapshots_dir, paused.snapshot_id)
    waiting = asyncio.create_task(machines._memory_written(directory))
    await asyncio.sleep(0.1)
    assert not waiting.done(), "a resume went ahead of the pause's memory"
    vm.deferred.go.set()
    await asyncio.wait_for(waiting, 5)
    assert vm.deferred.done and not snap.memory_pending(directory)
    assert not machines._pending and not Path(rec.vm_dir).exists()


async def test_a_kill_during_the_write_does_not_collect_the_snapshot_under_it(node) -> None:
    orch, machines, settings = node
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    directory = snapshot_store.directory(settings.snapshots_dir, orch.get(rec.id).snapshot_id)
    await orch.kill(rec.id)
    await orch.collect_garbage()
    assert snapshot_store.is_complete(directory), "collected while its memory was written"
    assert Path(rec.vm_dir).exists(), "the kill removed the directory of the VMM being read"
    assert vm.deferred is not None
    vm.deferred.go.set()
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    await orch.collect_garbage()
    assert not directory.exists()


async def test_a_snapshot_whose_write_never_finished_is_refused(node) -> None:
    _, machines, settings = node
    directory = settings.snapshots_dir / "interrupted"
    directory.mkdir(parents=True)
    snap.write_pending(directory, snap.PendingMemory(settings.vms_dir / "gone", True, {}))
    with pytest.raises(NotRestorable, match="memory layer is incomplete"):
        await machines._memory_written(directory)


async def test_a_restart_finds_committed_pending_pauses_only(node) -> None:
    _, machines, settings = node
    root = settings.snapshots_dir
    for name in ("committed", ".staging.partial-x"):
        (root / name).mkdir(parents=True)
        snap.write_pending(root / name, snap.PendingMemory(settings.vms_dir / name, True,
                                                           {"slot": 3}))
    (root / "committed" / snap.MANIFEST).write_text("{}")
    found = machines._pending_pauses()
    assert [(d.name, p.note) for d, p in found] == [("committed", {"slot": 3})]


async def test_a_burst_of_pauses_writes_at_most_pause_writes_memories_at_once(node) -> None:
    from aenv.orchestrator.node import PAUSE_WRITES

    orch, machines, settings = node
    made = [deferring_sandbox(orch, machines, settings) for _ in range(PAUSE_WRITES + 1)]
    for rec, _ in made:
        await orch.pause(rec.id)
    vms = [vm for _, vm in made]
    await asyncio.sleep(0.1)
    writing = [vm.deferred for vm in vms if vm.deferred is not None and vm.deferred.started]
    assert len(writing) == PAUSE_WRITES
    for vm in vms:
        assert vm.deferred is not None
        vm.deferred.go.set()
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert all(vm.deferred is not None and vm.deferred.done for vm in vms)
