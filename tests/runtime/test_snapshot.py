"""VM snapshots end to end under the qemu driver: pause to a directory and resume in another
slot, persistent snapshots of a running VM, forks, incremental snapshots of restored VMs,
and chains compacted at the driver's limit.

One VM is booted for the whole module; it is paused into the module's first snapshot,
and every other VM here is a restore (about 0.2 s each under TCG). The guest runs a counter
in the background (``/tmp/counter``, +1 every 0.2 s) and has a file written before the first
pause, so each restore can show that processes kept running and files are intact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.runtime import qemu_snapshot, write_tracking
from aenv.runtime.compaction import Compactor
from aenv.runtime.guest_memory import intersect_runs
from aenv.runtime.qemu import QemuRuntime
from aenv.storage import memory_compaction, snapshots
from tests.runtime.conftest import (
    GUEST_MIB,
    VM_PREFIX,
    Guest,
    boot_guest,
    destroy_guest,
    restore_guest,
)

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]

COUNTER = ("i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; "
           "mv /tmp/counter.new /tmp/counter; sleep 0.2; done")
BEFORE = "/home/user/before-pause.txt"
GUEST_RAM = GUEST_MIB << 20


def counter(guest: Guest) -> int:
    """The guest's counter (0 before its first tick)."""
    out = guest.sandbox().commands.run("cat /tmp/counter 2>/dev/null || echo 0").stdout
    return int(out.strip())


def counter_advances(guest: Guest, past: int, timeout: float = 10.0) -> int:
    """Wait until the guest's counter is beyond ``past``; return it."""
    deadline = time.monotonic() + timeout
    while (now := counter(guest)) <= past:
        assert time.monotonic() < deadline, f"counter stuck at {now} (was {past})"
        time.sleep(0.2)
    return now


@dataclass
class Origin:
    snapshot: Path
    token: str
    counter_at_pause: int
    old_slot_index: int


@pytest.fixture(scope="module")
def snap_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
async def origin(rt_settings, kernel, base_image, slot_pool, snap_dir) -> AsyncIterator[Origin]:
    """A booted guest with the counter running and a file written, paused to a snapshot.
    Its slot is held until the first restore has its own, so that one lands elsewhere."""
    g = await boot_guest(VM_PREFIX + "s0", rt_settings, kernel, base_image, slot_pool)
    try:
        sbx = g.sandbox()
        sbx.files.write(BEFORE, "written before the pause\n")
        sbx.commands.run(COUNTER, background=True)
        value = counter_advances(g, 1)
        info = await g.vm.snapshot(snap_dir / "paused", stop=True)
        assert not g.vm.is_alive()
        assert info.memory_layers == 1 and info.parent is None
        yield Origin(snap_dir / "paused", g.token, value, g.slot.index)
    finally:
        await destroy_guest(g, slot_pool)


@pytest.fixture(scope="module")
async def resumed(origin: Origin, rt_settings, slot_pool) -> AsyncIterator[Guest]:
    """The paused guest, resumed (a restored VM: its snapshots are incremental)."""
    g = await restore_guest(VM_PREFIX + "s1", origin.snapshot, rt_settings, slot_pool,
                            origin.token)
    yield g
    await destroy_guest(g, slot_pool)


def test_a_paused_vm_resumes_in_another_slot_with_processes_and_files_intact(
        origin: Origin, resumed: Guest) -> None:
    assert resumed.slot.index != origin.old_slot_index
    assert httpx.get(resumed.url + "/health", timeout=5).status_code == 204
    sbx = resumed.sandbox()
    assert sbx.files.read(BEFORE) == "written before the pause\n"
    # The counter kept its value across the pause and runs on.
    first = counter(resumed)
    assert first >= origin.counter_at_pause
    counter_advances(resumed, first)


async def test_restore_reaches_a_running_vmm_quickly_and_maps_memory_copy_on_write(
        resumed: Guest) -> None:
    t = resumed.vm.boot_timings
    assert t["qmp_ready"] <= t["memory_applied"] <= t["state_loaded"] <= t["running"]
    assert t["running"] < 5.0  # generous: a loaded 2-core TCG host; ~0.04 s when idle
    maps = Path(f"/proc/{resumed.vm.pid}/maps").read_text()
    base = str((resumed.vm.workdir / "base-memory").resolve())
    assert any(line.endswith(base) and " rw-p " in line for line in maps.splitlines())


def guest_ram(vm) -> dict[str, int]:
    """The VMM's guest RAM, in bytes by ``/proc/<pid>/smaps`` field (Rss, Pss, Shared_Clean,
    Anonymous, ...), summed over the VMAs that map the restored VM's ``base-memory``."""
    base = str((vm.workdir / "base-memory").resolve())
    totals: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{vm.pid}/smaps").read_text().splitlines():
        field, _, rest = line.partition(":")
        if " " in field:  # a VMA's first line: "start-end perms offset dev inode path"
            inside = line.split(maxsplit=5)[5:] == [base]
        elif inside and rest.endswith(" kB"):
            totals[field] = totals.get(field, 0) + int(rest.split()[0]) * 1024
    assert totals, f"pid {vm.pid} does not map {base}"
    return totals


async def fork(snapshot: Path, names: list[str], token: str, settings, pool) -> list[Guest]:
    results = await asyncio.gather(
        *(restore_guest(VM_PREFIX + n, snapshot, settings, pool, token) for n in names),
        return_exceptions=True)
    guests = [r for r in results if isinstance(r, Guest)]
    errors = [r for r in results if not isinstance(r, Guest)]
    if errors:
        for g in guests:
            await destroy_guest(g, pool)
        raise errors[0]
    return guests


async def test_a_persistent_snapshot_keeps_the_source_running_and_its_forks_independent(
        resumed: Guest, origin: Origin, rt_settings, slot_pool, snap_dir) -> None:
    before = counter(resumed)
    info = await resumed.vm.snapshot(snap_dir / "persistent")
    assert resumed.vm.is_alive() and await resumed.vm.status() == "running"
    assert 0 < info.freeze_s < info.total_s
    counter_advances(resumed, before)
    children = await fork(snap_dir / "persistent", ["s2a", "s2b"], origin.token, rt_settings,
                          slot_pool)
    try:
        a, b = children
        a.sandbox().files.write("/home/user/marker", "child a\n")
        b.sandbox().files.write("/var/tmp/other", "child b\n")
        assert not b.sandbox().files.exists("/home/user/marker")
        assert not resumed.sandbox().files.exists("/home/user/marker")
        assert not a.sandbox().files.exists("/var/tmp/other")
        for g in (a, b):
            assert g.sandbox().files.read(BEFORE) == "written before the pause\n"
            counter_advances(g, counter(g))
        # Each child holds as private copies (Anonymous) only the snapshot's diff it was
        # given and what it wrote since; the guest RAM it reads is the base memory file's
        # pages, mapped by its sibling and the source too (Shared_Clean). Measured under
        # TCG: diff 4 MB, Anonymous 10 MB, Shared_Clean 65 of 76 MB resident.
        assert a.vm.pid != b.vm.pid != resumed.vm.pid
        for g in (a, b):
            ram = guest_ram(g.vm)
            assert ram["Anonymous"] <= info.memory_bytes + GUEST_RAM // 16, ram
            assert ram["Shared_Clean"] >= ram["Rss"] // 2, ram
    finally:
        for g in children:
            await destroy_guest(g, slot_pool)


async def test_a_snapshot_of_a_restored_vm_records_only_the_pages_it_wrote(
        resumed: Guest, origin: Origin, rt_settings, slot_pool, snap_dir) -> None:
    sbx = resumed.sandbox()
    sbx.commands.run("head -c 16777216 /dev/urandom > /dev/shm/dirty", user="root")
    digest = sbx.commands.run("md5sum < /dev/shm/dirty").stdout.split()[0]
    info = await resumed.vm.snapshot(snap_dir / "incremental")
    m = snapshots.read_manifest(snap_dir / "incremental")
    assert m.parent is not None
    # one new diff layer on top of the parent's stack
    assert m.layers[:-1] == snapshots.read_manifest(m.parent).layers
    assert m.layers[-1].directory == snap_dir / "incremental" and m.layers[-1].kind == "diff"
    assert 16 << 20 <= info.memory_bytes < GUEST_RAM // 4
    assert m.sizes["memory"] < GUEST_RAM // 4  # the layer file is sparse
    assert m.sizes["device_state"] < 1 << 20
    (child,) = await fork(snap_dir / "incremental", ["s3"], origin.token, rt_settings,
                          slot_pool)
    try:
        out = child.sandbox().commands.run("md5sum < /dev/shm/dirty").stdout.split()[0]
        assert out == digest
        assert child.sandbox().files.read(BEFORE) == "written before the pause\n"
    finally:
        await destroy_guest(child, slot_pool)


async def test_a_vm_reattached_after_a_server_restart_still_snapshots_incrementally(
        resumed: Guest, snap_dir) -> None:
    old = resumed.vm
    await old.detach()  # what a server exit does
    vm = await QemuRuntime().attach(old.workdir)
    resumed.old_handles.append(old)
    resumed.vm = vm
    info = await vm.snapshot(snap_dir / "after-attach")
    m = snapshots.read_manifest(snap_dir / "after-attach")
    assert m.parent is not None and m.layers[:-1] == snapshots.read_manifest(m.parent).layers
    assert info.memory_bytes < GUEST_RAM // 4
    counter_advances(resumed, counter(resumed))


async def test_a_tracked_vm_snapshots_only_what_it_wrote_since_its_last_snapshot(
        origin: Origin, rt_settings, slot_pool, snap_dir) -> None:
    """``write_tracking``: the second snapshot compares only the pages written after the
    first, yet a fork of it has both the old and the new content."""
    source = await restore_guest(VM_PREFIX + "s6", origin.snapshot, rt_settings, slot_pool,
                                 origin.token)
    try:
        await _snapshots_twice_and_forks(source, origin, rt_settings, slot_pool, snap_dir)
    finally:
        await destroy_guest(source, slot_pool)


async def _snapshots_twice_and_forks(source: Guest, origin: Origin, rt_settings, slot_pool,
                                     snap_dir: Path) -> None:
    vm, sbx = source.vm, source.sandbox()
    sbx.commands.run("head -c 16777216 /dev/urandom > /dev/shm/kept", user="root")
    kept = sbx.commands.run("md5sum < /dev/shm/kept").stdout.split()[0]
    await vm.snapshot(snap_dir / "tracked1")
    assert write_tracking.take(vm.workdir, vm.pid) == snap_dir / "tracked1"
    write_tracking.remember(vm.workdir, vm.pid, snap_dir / "tracked1")  # as it was
    sbx.commands.run("head -c 1048576 /dev/urandom > /dev/shm/new", user="root")
    new = sbx.commands.run("md5sum < /dev/shm/new").stdout.split()[0]
    used: list[int] = []

    def intersect(private, written):
        used.append(sum(n for _, n in written))
        return intersect_runs(private, written)

    with pytest.MonkeyPatch.context() as mp:  # the record is used
        mp.setattr(qemu_snapshot.gm, "intersect_runs", intersect)
        info = await vm.snapshot(snap_dir / "tracked2")
    assert len(used) == 1 and 0 < used[0] < 4096, used  # < 16 MiB recorded
    m = snapshots.read_manifest(snap_dir / "tracked2")
    assert m.layers[:-1] == snapshots.read_manifest(snap_dir / "tracked1").layers
    assert 1 << 20 <= info.memory_bytes < 8 << 20  # the new file and what the guest did
    assert (vm.workdir / write_tracking.TOKEN).exists()
    (child,) = await fork(snap_dir / "tracked2", ["s6a"], origin.token, rt_settings, slot_pool)
    try:
        out = child.sandbox().commands.run("md5sum < /dev/shm/kept; md5sum < /dev/shm/new")
        assert out.stdout.split()[::2] == [kept, new]
        # the record started at the restore
        assert write_tracking.take(child.vm.workdir, child.vm.pid) == snap_dir / "tracked2"
    finally:
        await destroy_guest(child, slot_pool)


async def test_a_chain_deeper_than_the_limit_is_compacted_and_still_restores(
        origin: Origin, rt_settings, slot_pool, snap_dir) -> None:
    """The memory stack (merged into one diff) and the drive's chain, both in the
    background (``Compactor``), while the VM resumed from the snapshot being compacted runs,
    pauses and resumes on; no capture compacts within itself."""
    runtime = QemuRuntime(max_chain=2, track_writes=rt_settings.native_dir)
    compactor = Compactor(runtime, asyncio.Lock(), release_after_s=0.0)
    guest = await restore_guest(VM_PREFIX + "s4", origin.snapshot, rt_settings, slot_pool,
                                origin.token, runtime)
    depths, compacted = [], []
    try:
        for i in range(4):
            sbx = guest.sandbox()
            sbx.files.write(f"/home/user/gen{i}", f"generation {i}\n")
            sbx.commands.run(f"head -c 1048576 /dev/urandom > /dev/shm/gen{i}", user="root")
            directory = snap_dir / f"chain{i}"
            info = await guest.vm.snapshot(directory, stop=True)
            await destroy_guest(guest, slot_pool)
            compactor.schedule(directory)
            compacted.append(info.compacted)
            guest = await restore_guest(VM_PREFIX + f"s4-{i}", directory, rt_settings,
                                        slot_pool, origin.token, runtime)
            await compactor.settle()
            m = snapshots.read_manifest(directory)
            depths.append((m.diff_depth, len(m.drive("rootfs").chain)))
        assert all(mem <= 2 and disk + 1 <= 2 for mem, disk in depths), depths
        assert not any(compacted), depths  # within 2 * max_chain: no inline compaction
        assert compactor.history, depths  # the memory stack and the drive, after it
        merged = [snapshots.read_manifest(snap_dir / f"chain{i}") for i in range(4)]
        assert any(m.layers[-1].name == memory_compaction.MERGED and not m.retired
                   for m in merged), depths
        sbx = guest.sandbox()
        for i in range(4):
            assert sbx.files.read(f"/home/user/gen{i}") == f"generation {i}\n"
            assert sbx.commands.run(f"wc -c < /dev/shm/gen{i}").stdout.strip() == "1048576"
        counter_advances(guest, counter(guest))
    finally:
        await compactor.close()
        await destroy_guest(guest, slot_pool)


async def test_a_full_snapshot_depends_on_no_other_snapshot(
        resumed: Guest, origin: Origin, rt_settings, slot_pool, snap_dir) -> None:
    info = await resumed.vm.snapshot(snap_dir / "full", incremental=False)
    assert info.memory_layers == 1 and info.compacted
    assert snapshots.dependencies(snap_dir / "full") == set()
    assert snapshots.read_manifest(snap_dir / "full").drive("rootfs").chain == ()
    (child,) = await fork(snap_dir / "full", ["s5"], origin.token, rt_settings, slot_pool)
    try:
        assert child.sandbox().files.read(BEFORE) == "written before the pause\n"
        counter_advances(child, counter(child))
    finally:
        await destroy_guest(child, slot_pool)


async def test_a_deferred_pause_is_restorable_only_once_its_memory_is_written(
        origin: Origin, rt_settings, slot_pool, snap_dir, tmp_path) -> None:
    """``pause_deferred`` of a restored VM answers with the VMM alive and frozen and the
    snapshot committed but marked; the marker keeps a restore out until the memory is
    written. The write here is the one a restarted server makes (``deferred_memory`` of
    the adopted VMM) over an interrupted attempt's leftovers; the result restores with
    the guest's memory and files of the moment of the pause."""
    from aenv.runtime.base import RestoreOverrides, SnapshotError
    from aenv.runtime.qemu_snapshot import prepare_restore

    g = await restore_guest(VM_PREFIX + "s7", origin.snapshot, rt_settings, slot_pool,
                            origin.token)
    directory = snap_dir / "deferred"
    try:
        sbx = g.sandbox()
        sbx.commands.run("head -c 16777216 /dev/urandom > /dev/shm/dirty", user="root")
        digest = sbx.commands.run("md5sum < /dev/shm/dirty").stdout.split()[0]
        sbx.files.write("/home/user/deferred.txt", "before the deferred pause\n")
        info, pending = await g.vm.pause_deferred(directory, {"slot": g.slot.index})
        assert pending is not None and g.vm.is_alive()
        assert await g.vm.status() == "paused" and info.memory_bytes == 0
        assert snapshots.memory_pending(directory)
        marker = snapshots.read_pending(directory)
        assert marker is not None and marker.note == {"slot": g.slot.index}
        with pytest.raises(SnapshotError, match="incomplete"):
            prepare_restore(directory, RestoreOverrides(vm_id="x", workdir=tmp_path / "x"))
        (directory / snapshots.MEMORY).write_bytes(b"an interrupted attempt")
        phases = await g.vm.deferred_memory(directory).write()
        assert {"memory_copy", "memory_fsync", "memory_manifest", "vmm_stop"} <= set(phases)
        assert not g.vm.is_alive() and not snapshots.memory_pending(directory)
        m = snapshots.read_manifest(directory)
        assert m.layers[-1].directory == directory and m.layers[-1].kind == "diff"
        assert m.sizes["memory"] >= 16 << 20
    finally:
        await destroy_guest(g, slot_pool)
    child = await restore_guest(VM_PREFIX + "s8", directory, rt_settings, slot_pool,
                                origin.token)
    try:
        csbx = child.sandbox()
        assert csbx.commands.run("md5sum < /dev/shm/dirty").stdout.split()[0] == digest
        assert csbx.files.read("/home/user/deferred.txt") == "before the deferred pause\n"
        counter_advances(child, counter(child))
    finally:
        await destroy_guest(child, slot_pool)
