"""A pause that answers before its memory is written (``NodeMachines``'s deferred pause):
the sandbox is ``paused`` at once, a resume waits for the write, a kill meanwhile abandons
the write (unless it is committing, or something else still names the snapshot: then
collection waits for it), and a snapshot whose write never finished is refused with the
reason. A resume while the write is pending continues the frozen VM in
place (``_resume_in_place``) and abandons the snapshot: raced against the write's commit,
against another resume, after a kill, and cut by a restart (``recover_in_place``). The
machines, store and orchestrator are real; the VM is a stand-in whose memory write waits
for the test (``Deferring``), envd's ``/init`` is counted, not sent.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from aenv.orchestrator.errors import NotRestorable, SandboxNotFound
from aenv.orchestrator.machine import Placement
from aenv.orchestrator.node import NodeMachines
from aenv.runtime.base import DeferredMemory, MemoryWriteAbandoned, SnapshotInfo
from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap
from tests.orchestrator.test_node_snapshot_safety import SlowVM, node, running_sandbox

__all__ = ["node"]  # the fixture, used by name below


class Deferring(DeferredMemory):
    """Writes nothing until ``go`` is set; then removes the marker as the real one does.
    ``abandon`` wins until the write commits (``committing``: set by the test to stand
    for a write that closed its gate), as ``QemuDeferredMemory``'s does."""

    def __init__(self, directory: Path, vm: DeferringVM) -> None:
        self.directory = directory
        self.vm = vm  # type: ignore[assignment]
        self.go = asyncio.Event()
        self.started = False
        self.done = False
        self.committing = False
        self.abandons: list[bool] = []

    async def write(self) -> dict[str, float]:
        self.started = True
        await self.go.wait()
        if self.abandons and self.abandons[-1]:
            raise MemoryWriteAbandoned("abandoned")
        self.committing = True
        (self.directory / snap.MEMORY_PENDING).unlink()
        self.done = True
        return {"memory_copy": 0.0}

    async def abandon(self) -> bool:
        ok = not self.committing
        self.abandons.append(ok)
        if ok and snap.memory_pending(self.directory):  # a second time: done already
            snap.abandon_pending(self.directory)
        if ok:
            self.go.set()  # the write stops (the real one: at its next chunk)
        return ok


class DeferringVM(SlowVM):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, delay=0.0)
        self.deferred: Deferring | None = None

    async def pause_deferred(self, directory: Path, note: dict[str, object] | None = None
                             ) -> tuple[SnapshotInfo, Deferring]:
        info = await self.snapshot(directory, stop=False)
        snap.write_pending(directory, snap.PendingMemory(self.workdir, True, dict(note or {})))
        self.deferred = Deferring(directory, self)
        return info, self.deferred

    def deferred_memory(self, directory: Path) -> Deferring:
        self.deferred = Deferring(directory, self)
        return self.deferred


def deferring_sandbox(orch, machines: NodeMachines, settings):
    rec, _ = running_sandbox(orch, machines, settings)
    vm = DeferringVM(Path(rec.vm_dir))
    machines._running[rec.id].vm = vm
    return rec, vm


def count_inits(machines: NodeMachines) -> list[str]:
    """envd's ``/init`` calls (sandbox ids) instead of sending them."""
    inits: list[str] = []

    async def init_envd(url, rec, template, **kwargs) -> None:
        inits.append(rec.id)

    machines._init_envd = init_envd  # type: ignore[method-assign]
    return inits


def count_restores(machines: NodeMachines) -> list[str]:
    """Restores (snapshot names) instead of making them."""
    restores: list[str] = []

    async def restore(rec, template, directory, *, pooled=True) -> Placement:
        assert not snap.memory_pending(directory), "restored a snapshot still being written"
        restores.append(directory.name)
        return Placement(vm_dir=rec.vm_dir, vm_pid=1, slot=8, host_ip="10.11.0.8",
                         runtime="fake")

    machines._restore = restore  # type: ignore[method-assign]
    return restores


def count_releases(machines: NodeMachines) -> list[int]:
    released: list[int] = []
    machines._release = lambda slot: released.append(slot.index)  # type: ignore[method-assign]
    return released


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


async def test_a_kill_during_the_write_abandons_it_and_frees_the_vm_at_once(node) -> None:
    orch, machines, settings = node
    released = count_releases(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    directory = snapshot_store.directory(settings.snapshots_dir, orch.get(rec.id).snapshot_id)
    await orch.kill(rec.id)
    assert vm.deferred is not None and vm.deferred.abandons == [True]
    assert "stop" in vm.calls and released == [7] and not Path(rec.vm_dir).exists()
    assert not directory.exists(), "the killed sandbox's pause snapshot was kept"
    assert not machines._deferred and not machines._pending_workdirs
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert not vm.deferred.done and released == [7]


async def test_a_kill_as_the_write_commits_lets_it_finish_then_collects_it(node) -> None:
    orch, machines, settings = node
    released = count_releases(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    directory = snapshot_store.directory(settings.snapshots_dir, orch.get(rec.id).snapshot_id)
    assert vm.deferred is not None
    vm.deferred.committing = True  # the write closed its gate: too late to abandon
    await orch.kill(rec.id)
    assert vm.deferred.abandons == [False]
    assert snapshot_store.is_complete(directory), "collected while its memory was written"
    assert Path(rec.vm_dir).exists(), "the kill removed the directory of the VMM being read"
    vm.deferred.go.set()
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert vm.deferred.done and released == [7] and not Path(rec.vm_dir).exists()
    await orch.collect_garbage()
    assert not directory.exists()


async def test_a_kill_during_the_write_keeps_a_snapshot_something_else_names(node) -> None:
    orch, machines, settings = node
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    ref = orch.get(rec.id).snapshot_id
    directory = snapshot_store.directory(settings.snapshots_dir, ref)
    with orch.pins.hold(ref):  # an operation still reads it (as a restore's pin)
        await orch.kill(rec.id)
        assert vm.deferred is not None and vm.deferred.abandons == []
        assert snap.memory_pending(directory) and Path(rec.vm_dir).exists()
        vm.deferred.go.set()
        await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
        assert vm.deferred.done and snapshot_store.is_complete(directory)
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


async def test_a_resume_during_the_write_continues_the_frozen_vm_in_place(node) -> None:
    orch, machines, settings = node
    inits, restores, released = (count_inits(machines), count_restores(machines),
                                 count_releases(machines))
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    directory = snapshot_store.directory(settings.snapshots_dir, orch.get(rec.id).snapshot_id)
    resumed = await orch.resume(rec.id, timeout=60)
    assert resumed.state == "running" and resumed.snapshot_id is None
    assert (resumed.slot, resumed.host_ip, resumed.vm_dir) == (7, "10.11.0.7", rec.vm_dir)
    assert resumed.end_at > orch.clock() + 50
    assert vm.calls[-1] == "resume" and "stop" not in vm.calls and vm.alive
    assert inits == [rec.id] and restores == [] and released == []
    assert snap.memory_abandoned(directory) and not snap.memory_pending(directory)
    assert machines.is_running(resumed) and Path(rec.vm_dir).is_dir()
    assert vm.deferred is not None  # the write finds itself abandoned and touches nothing
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert not vm.deferred.done and released == [] and Path(rec.vm_dir).is_dir()
    await orch.collect_garbage()
    assert not directory.exists(), "the abandoned snapshot was kept"
    with pytest.raises(NotRestorable, match="continued its VM in place"):
        abandoned = settings.snapshots_dir / "abandoned"
        abandoned.mkdir()
        snap.write_pending(abandoned, snap.PendingMemory(Path(rec.vm_dir), True, {}))
        snap.abandon_pending(abandoned)
        await machines._memory_written(abandoned)


async def test_a_resume_as_the_write_commits_waits_for_it_and_restores(node) -> None:
    orch, machines, settings = node
    inits, restores = count_inits(machines), count_restores(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    name = orch.get(rec.id).snapshot_id.split(":", 1)[1]
    assert vm.deferred is not None
    vm.deferred.committing = True  # the write closed its gate: too late to abandon
    resuming = asyncio.create_task(orch.resume(rec.id, timeout=60))
    await asyncio.sleep(0.1)
    assert not resuming.done(), "the resume did not wait for the committing write"
    vm.deferred.go.set()
    resumed = await asyncio.wait_for(resuming, 5)
    assert vm.deferred.abandons == [False] and vm.deferred.done
    assert restores == [name] and resumed.slot == 8
    assert "resume" not in vm.calls and inits == []


async def test_two_resumes_at_once_continue_the_vm_once(node) -> None:
    orch, machines, settings = node
    inits = count_inits(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    results = await asyncio.gather(orch.connect(rec.id, 60), orch.connect(rec.id, 60))
    assert sorted(resumed for _, resumed in results) == [False, True]
    assert vm.deferred is not None and vm.deferred.abandons == [True]
    assert vm.calls.count("resume") == 1 and inits == [rec.id]
    assert orch.get(rec.id).state == "running"


async def test_a_kill_during_the_write_leaves_nothing_to_resume_in_place(node) -> None:
    orch, machines, settings = node
    released = count_releases(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    await orch.kill(rec.id)
    with pytest.raises(SandboxNotFound):
        await orch.resume(rec.id, timeout=60)
    assert vm.deferred is not None and vm.deferred.abandons == [True]  # by the kill
    assert "resume" not in vm.calls and "stop" in vm.calls
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert released == [7] and not Path(rec.vm_dir).exists()
    assert not machines._deferred and not machines._pending_workdirs


async def test_a_failed_init_after_the_abandon_leaves_it_paused_and_refused(node) -> None:
    orch, machines, settings = node
    released = count_releases(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)

    async def init_envd(url, rec, template, **kwargs) -> None:
        raise ConnectionError("envd did not answer")

    machines._init_envd = init_envd  # type: ignore[method-assign]
    await orch.pause(rec.id)
    with pytest.raises(ConnectionError):
        await orch.resume(rec.id, timeout=60)
    paused = orch.get(rec.id)
    assert paused.state == "paused" and not vm.alive and released == [7]
    with pytest.raises(NotRestorable, match="continued its VM in place"):
        await orch.resume(rec.id, timeout=60)


def interrupted_in_place(orch, machines: NodeMachines, settings, vm_alive: bool):
    """What a restart finds after a resume in place abandoned the snapshot: the record
    ``resuming``, the marker ``memory.abandoned``, the VMM alive (or not)."""
    rec, _ = running_sandbox(orch, machines, settings)
    machines._running.pop(rec.id)
    directory = settings.snapshots_dir / "pausedsnap"
    ref = "snapshot:pausedsnap"
    staging = snap.begin(directory)
    (staging / snap.DEVICE_STATE).write_bytes(b"state")
    (staging / snap.MEMORY).write_bytes(bytes(1 << 20))
    snap.write_pending(staging, snap.PendingMemory(Path(rec.vm_dir), True,
                                                   {"slot": 7, "sandbox": rec.id}))
    snap.commit(staging, directory, snap.Manifest(
        driver="fake", vm={}, memory_size=1 << 20,
        layers=(snap.MemoryLayer(directory, "full", 0),), drives=()))
    snap.abandon_pending(directory)
    for was, state in (("running", "pausing"), ("pausing", "paused"),
                       ("paused", "resuming")):
        assert orch.sandboxes.transition(rec.id, [was], state, snapshot_id=ref, slot=None,
                                         host_ip=None, vm_pid=None)
    vm = DeferringVM(Path(rec.vm_dir))
    vm.paused = True

    async def attach(vm_dir: Path) -> DeferringVM:
        from aenv.runtime import AttachError
        if not vm_alive:
            raise AttachError("no VMM")
        assert vm_dir == Path(rec.vm_dir)
        return vm

    class Slot:
        index = 7
        host_ip = "10.11.0.7"

    machines.runtime.attach = attach  # type: ignore[method-assign]
    machines.pool.adopt = lambda index, policy=None: Slot()  # type: ignore[method-assign]
    return rec, vm, directory


async def test_a_restart_finishes_a_resume_in_place_it_cut(node) -> None:
    orch, machines, settings = node
    inits = count_inits(machines)
    rec, vm, directory = interrupted_in_place(orch, machines, settings, vm_alive=True)
    await orch.recover()
    after = orch.get(rec.id)
    assert after.state == "running" and after.snapshot_id is None
    assert (after.slot, after.host_ip, after.vm_dir) == (7, "10.11.0.7", rec.vm_dir)
    assert "resume" in vm.calls and not vm.paused and inits == [rec.id]
    assert vm.deferred is not None and vm.deferred.abandons == [True]
    assert machines.is_running(after)
    assert not directory.exists(), "the abandoned snapshot was kept after the recovery"


async def test_a_restart_reports_lost_a_resume_in_place_whose_vm_died(node) -> None:
    orch, machines, settings = node
    rec, _, directory = interrupted_in_place(orch, machines, settings, vm_alive=False)
    await orch.recover()
    assert orch.sandboxes.get(rec.id) is None  # ended
    ended = orch.sandboxes.get(rec.id, live_only=False)
    assert ended is not None and ended.state == "lost" and "did not survive" in ended.reason
    assert not directory.exists()


async def test_a_restart_tells_abandoned_pauses_from_pending_ones(node) -> None:
    _, machines, settings = node
    root = settings.snapshots_dir
    for name in ("abandoned", "pending"):
        (root / name).mkdir(parents=True)
        (root / name / snap.MANIFEST).write_text("{}")
        snap.write_pending(root / name, snap.PendingMemory(settings.vms_dir / name, True,
                                                           {"slot": 3}))
    snap.abandon_pending(root / "abandoned")
    assert [d.name for d, _ in machines._abandoned_pauses()] == ["abandoned"]
    assert [d.name for d, _ in machines._pending_pauses()] == ["pending"]


async def test_a_kill_whose_abandon_fails_still_ends_the_vm_and_frees_its_slot(node) -> None:
    orch, machines, settings = node
    released = count_releases(machines)
    rec, vm = deferring_sandbox(orch, machines, settings)
    await orch.pause(rec.id)
    assert vm.deferred is not None
    deferred = vm.deferred

    async def failing_abandon() -> bool:
        deferred.abandons.append(True)
        deferred.go.set()  # the write stops (its gate is abandoned), then the rename fails
        raise OSError("no space left on device")

    deferred.abandon = failing_abandon  # type: ignore[method-assign]
    await orch.kill(rec.id)
    await asyncio.wait_for(asyncio.gather(*machines._pending.values()), 5)
    assert "stop" in vm.calls and released == [7] and not Path(rec.vm_dir).exists()
    assert not machines._deferred and not deferred.done


def adopting(machines: NodeMachines) -> list[int]:
    """``pool.adopt`` of any index, counted (slot indices)."""
    adopted: list[int] = []

    def adopt(index: int, policy=None):
        adopted.append(index)

        class Slot:
            host_ip = f"10.11.0.{index}"
        Slot.index = index  # type: ignore[attr-defined]
        return Slot()

    machines.pool.adopt = adopt  # type: ignore[method-assign]
    return adopted


async def test_a_slot_kept_for_a_resume_in_place_nobody_finishes_is_freed_at_recovery(
        node) -> None:
    """``prepare`` keeps an abandoned snapshot's slot while a live record names its VMM's
    directory; only ``recover_in_place`` (a record resuming from that snapshot) adopts it.
    One no recovery took (the abandoned snapshot outlived its resume and the sandbox runs
    in another slot now) is freed once the recovery is over, not reserved until the next
    restart; the one a resume in place took stays its."""
    orch, machines, settings = node
    inits, released = count_inits(machines), count_releases(machines)
    rec, _, _ = interrupted_in_place(orch, machines, settings, vm_alive=True)
    adopted = adopting(machines)
    machines._in_place_slots = {7, 5}  # 7: this resume's; 5: a stale abandoned snapshot's
    await orch.recover()
    assert orch.get(rec.id).state == "running" and orch.get(rec.id).slot == 7
    assert inits == [rec.id]
    assert adopted == [7, 5] and released == [5]
    assert not machines._in_place_slots


async def test_a_resume_in_place_whose_directory_is_gone_adopts_no_slot(node) -> None:
    """Its slot was not kept (``prepare`` keeps it only while the VMM's directory exists):
    the index may be a warm slot or another sandbox's by now, so it is not taken."""
    orch, machines, settings = node
    rec, _, _ = interrupted_in_place(orch, machines, settings, vm_alive=True)
    adopted = adopting(machines)
    shutil.rmtree(rec.vm_dir)
    await orch.recover()
    ended = orch.sandboxes.get(rec.id, live_only=False)
    assert ended is not None and ended.state == "lost"
    assert "working directory is gone" in ended.reason
    assert adopted == []
