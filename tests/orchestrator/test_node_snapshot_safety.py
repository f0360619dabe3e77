"""Snapshots are never lost to a racing garbage collection or a failed pause.

The node's machines, store and orchestrator are the real ones, and so are the snapshot
files; only the VM is a stand-in (``SlowVM``) whose capture takes a while, so a collection
can be started while a snapshot is being written. What this proves: the roots are taken
under the snapshot lock, in-flight references are pinned, a failed filesystem pause keeps
the disk and the VM, and the record names the state that is true afterwards.
"""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.node import NodeMachines, _Running
from aenv.orchestrator.service import Orchestrator
from aenv.runtime.base import SnapshotInfo
from aenv.storage import durable, snapshot_store
from aenv.storage import snapshots as snap
from aenv.storage.disks import Disk
from aenv.store import SandboxRecord
from tests.orchestrator.test_orchestrator import stores_with_base

MEMORY = 1 << 20


class SlowVM:
    """Writes a minimal but complete snapshot after ``delay`` seconds."""

    def __init__(self, workdir: Path, delay: float = 0.3) -> None:
        self.workdir = workdir
        self.console_log = workdir / "console.log"
        self.delay = delay
        self.pid = 4242
        self.alive = True
        self.paused = False
        self.calls: list[str] = []

    def is_alive(self) -> bool:
        return self.alive

    def active_drive(self, drive_id: str) -> Path:
        return self.workdir / "rootfs.raw"

    async def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def stop(self, timeout: float = 5.0) -> None:
        self.calls.append("stop")
        self.alive = False

    async def pause_deferred(self, directory: Path, note: dict[str, object] | None = None
                             ) -> tuple[SnapshotInfo, None]:
        """As a driver that defers nothing (``VM.pause_deferred``'s default)."""
        return await self.snapshot(directory, stop=True), None

    async def snapshot(self, directory: Path, *, stop: bool = False,
                       incremental: bool = True) -> SnapshotInfo:
        staging = snap.begin(directory)
        (staging / snap.DEVICE_STATE).write_bytes(b"state")
        with open(staging / snap.MEMORY, "wb") as f:
            f.truncate(MEMORY)
        await asyncio.sleep(self.delay)
        manifest = snap.Manifest(driver="fake", vm={}, memory_size=MEMORY,
                                 layers=(snap.MemoryLayer(directory, "full", 0),), drives=())
        snap.commit(staging, directory, manifest)
        if stop:
            self.alive = False
        return SnapshotInfo(directory=directory, parent=None, freeze_s=0.0, total_s=0.0,
                            memory_bytes=0, memory_layers=1, disk_bytes=0, compacted=False)


class FakeSlot:
    index = 7
    host_ip = "10.11.0.7"


@pytest.fixture
def node(tmp_path):
    settings = Settings(home=tmp_path / "home", name_prefix="aenvtst")
    machines = NodeMachines(settings)
    machines._release = lambda slot: None  # no real slot behind FakeSlot
    db, sandboxes, templates = stores_with_base()
    orch = Orchestrator(sandboxes, templates, machines)
    yield orch, machines, settings
    db.close()


def running_sandbox(orch: Orchestrator, machines: NodeMachines, settings: Settings,
                    delay: float = 0.3) -> tuple[SandboxRecord, SlowVM]:
    now = time.time()
    rec = SandboxRecord(id=f"sbx{len(machines._running)}", template_id="base", state="running",
                        client_id="t", started_at=now, end_at=now + 300, cpu_count=1,
                        memory_mb=256, disk_size_mb=1024, slot=7, host_ip="10.11.0.7")
    workdir = settings.vms_dir / rec.id
    workdir.mkdir(parents=True)
    rec.vm_dir = str(workdir)
    orch.sandboxes.insert(rec)
    vm = SlowVM(workdir, delay)
    disk = workdir / "rootfs.raw"
    disk.write_bytes(b"the only copy of the user's files" * 1000)
    machines._running[rec.id] = _Running(vm, FakeSlot(), Disk(disk, "raw", "reflink", disk))
    return rec, vm


def snapshot_dirs(settings: Settings) -> list[Path]:
    root = settings.snapshots_dir
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() \
        else []


async def test_a_snapshot_committed_while_gc_waits_survives(node) -> None:
    orch, machines, settings = node
    rec, _ = running_sandbox(orch, machines, settings)
    task = asyncio.create_task(orch.snapshot(rec.id, name="keep-me"))
    await asyncio.sleep(0.1)  # the capture holds the snapshot lock now
    await orch.collect_garbage()
    snapshot = await task
    directory = snapshot_store.directory(settings.snapshots_dir, snapshot.image)
    assert snapshot_store.is_complete(directory), "GC deleted a snapshot a record names"


async def test_a_fork_capture_survives_its_source_being_killed(node) -> None:
    orch, machines, settings = node
    rec, _ = running_sandbox(orch, machines, settings)
    seen: list[bool] = []

    async def start(child, template):
        # The source goes away while the children restore from its capture.
        await orch.kill(rec.id)
        directory = snapshot_store.directory(settings.snapshots_dir, template.image)
        seen.append(snapshot_store.is_complete(directory))
        raise RuntimeError("stop here: only the capture's survival is under test")

    machines.start = start
    await orch.fork(rec.id, 1)
    assert seen == [True], "the fork's capture was collected while a child restored it"


async def test_a_build_image_is_kept_until_the_template_names_it(node) -> None:
    orch, machines, settings = node
    rec, _ = running_sandbox(orch, machines, settings)
    builder = Builder(orch.templates, machines, settings.cache_dir, pins=orch.pins)
    image = "snapshot:buildimage0000000000"

    async def writer() -> None:
        # What a build's finalize does: pause to the new image, then name it.
        with builder.pins.hold(image):
            await machines.pause(rec, True, image)
            await asyncio.sleep(0.2)  # the gap before the template record is updated
            orch.templates.update("base", image=image)

    task = asyncio.create_task(writer())
    await asyncio.sleep(0.1)
    await orch.collect_garbage()  # waits for the pause, then must see the pin
    await task
    assert snapshot_store.is_complete(snapshot_store.directory(settings.snapshots_dir, image))


async def test_unreadable_dependencies_delete_nothing(node, tmp_path) -> None:
    _, _, settings = node
    root = settings.snapshots_dir
    parent = root / "parent"
    child = root / "child"
    for d in (parent, child):
        d.mkdir(parents=True)
    (parent / snap.MANIFEST).write_text("{}")
    (child / snap.MANIFEST).write_text("not json {")  # the root's manifest is corrupt
    with pytest.raises(snapshot_store.DependenciesUnknown):
        snapshot_store.collect(root, settings.layers_dir, ["snapshot:child"])
    assert parent.is_dir() and child.is_dir()


async def test_unreadable_backing_chain_deletes_nothing(node) -> None:
    _, _, settings = node
    layers = settings.layers_dir
    layers.mkdir(parents=True)
    (layers / "parent.qcow2").write_bytes(b"base layer")
    (layers / "child.qcow2").write_bytes(b"QFI\xfb but truncated")  # qemu-img cannot read it
    with pytest.raises(snapshot_store.DependenciesUnknown):
        snapshot_store.collect(settings.snapshots_dir, layers, ["layer:child"])
    assert (layers / "parent.qcow2").exists()


async def test_gc_that_cannot_read_a_dependency_reports_zero(node) -> None:
    orch, _, settings = node
    d = settings.snapshots_dir / "kept"
    d.mkdir(parents=True)
    (d / snap.MANIFEST).write_text("garbage")
    other = settings.snapshots_dir / "unrelated"
    other.mkdir()
    orch.templates.update("base", image="snapshot:kept")
    assert await orch.collect_garbage() == 0
    assert other.is_dir()


def _fail_at(monkeypatch, target: str) -> None:
    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    obj, name = {"link": (snapshot_store.os, "link"),
                 "manifest": (durable, "write_atomic"),
                 "fsync": (durable, "fsync_tree"),
                 "rename": (durable, "rename_durably")}[target]
    monkeypatch.setattr(obj, name, boom)


@pytest.mark.parametrize("step", ["link", "manifest", "fsync", "rename"])
async def test_a_failed_filesystem_pause_keeps_the_disk_and_the_vm(node, monkeypatch,
                                                                    step) -> None:
    orch, machines, settings = node
    rec, vm = running_sandbox(orch, machines, settings)
    disk = Path(rec.vm_dir) / "rootfs.raw"
    content = disk.read_bytes()

    async def no_sync(rec, running):
        return None

    monkeypatch.setattr(machines, "_sync_guest", no_sync)
    _fail_at(monkeypatch, step)
    with pytest.raises(OSError):
        await orch.pause(rec.id, memory=False)
    assert disk.read_bytes() == content, "the disk was lost"
    assert vm.alive and not vm.paused and "stop" not in vm.calls
    assert orch.get(rec.id).state == "running"
    assert snapshot_dirs(settings) == []


async def test_a_filesystem_pause_commits_before_the_vm_ends(node, monkeypatch) -> None:
    orch, machines, settings = node
    rec, vm = running_sandbox(orch, machines, settings)

    async def no_sync(rec, running):
        return None

    monkeypatch.setattr(machines, "_sync_guest", no_sync)
    await orch.pause(rec.id, memory=False)
    assert vm.calls == ["pause", "stop"]
    cur = orch.get(rec.id)
    assert cur.state == "paused" and cur.pause_mode == "filesystem"
    disk = snapshot_store.disk_snapshot(
        snapshot_store.directory(settings.snapshots_dir, cur.snapshot_id))
    assert disk is not None and disk.drive.read_bytes().startswith(b"the only copy")


async def test_a_pause_whose_vm_died_is_lost_not_running(node, monkeypatch) -> None:
    orch, machines, settings = node
    rec, vm = running_sandbox(orch, machines, settings)

    async def dies(directory, *, stop=False, incremental=True):
        vm.alive = False
        raise OSError(errno.EIO, "VMM crashed")

    monkeypatch.setattr(vm, "snapshot", dies)
    with pytest.raises(OSError):
        await orch.pause(rec.id)
    ended = orch.sandboxes.get(rec.id, live_only=False)
    assert ended is not None and ended.state == "lost"


async def test_a_pause_committed_before_the_vm_end_failed_is_paused(node, monkeypatch) -> None:
    orch, machines, settings = node
    rec, vm = running_sandbox(orch, machines, settings)

    async def no_sync(rec, running):
        return None

    async def stop_fails(timeout: float = 5.0) -> None:
        raise RuntimeError("quit timed out")

    monkeypatch.setattr(machines, "_sync_guest", no_sync)
    monkeypatch.setattr(vm, "stop", stop_fails)
    with pytest.raises(RuntimeError):
        await machines.pause(rec, False, "snapshot:direct")
    assert machines.has_snapshot("snapshot:direct")
    # Through the orchestrator the committed snapshot wins: the record says paused.
    rec2, vm2 = running_sandbox(orch, machines, settings)
    monkeypatch.setattr(vm2, "stop", stop_fails)
    orig_stop = machines.stop

    async def stop(rec):
        machines._running.pop(rec.id, None)
        await orig_stop(rec)

    monkeypatch.setattr(machines, "stop", stop)
    await orch.pause(rec2.id, memory=False)
    assert orch.get(rec2.id).state == "paused"
