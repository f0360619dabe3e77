"""The pool of pre-started VMMs (``aenv.runtime.vmm_pool``) with real QEMU processes in real
network slots: a pooled VMM becomes a running guest by loading its state alone; the pool
refills to the recent demand, never beyond its memory budget; a pooled VMM killed with
SIGKILL is discarded and the next take gets a live one (or none: the caller restores as
usual); a snapshot that goes away takes its pooled VMMs with it; ``close`` and (after a
crash) ``sweep`` leave no process, directory or slot behind.

One guest is booted and paused into the module's "template" snapshot; every pooled VMM
restores it. The pool's working directories live under ``<vms_dir>/rt-pool`` so the
suite's leak guard sees them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from aenv.network import NetworkSlot, SlotPool
from aenv.runtime import workdir as wd
from aenv.runtime.base import VMError
from aenv.runtime.qemu import Prestarted, QemuRuntime
from aenv.runtime.ready import wait_for_envd
from aenv.runtime.vmm_pool import PREFIX, VMMPool
from tests.runtime.conftest import GUEST_MIB, VM_PREFIX, Guest, boot_guest, destroy_guest

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
async def template(rt_settings, kernel, base_image, slot_pool,
                   tmp_path_factory) -> AsyncIterator[Path]:
    """A booted guest paused into a snapshot: what a template is on a node."""
    g = await boot_guest(VM_PREFIX + "pool-src", rt_settings, kernel, base_image, slot_pool)
    directory = tmp_path_factory.mktemp("pool") / "template"
    try:
        await g.vm.snapshot(directory, stop=True)
    finally:
        await destroy_guest(g, slot_pool)
    yield directory


@pytest.fixture
def pool_dir(rt_settings) -> Iterator[Path]:
    d = rt_settings.vms_dir / (VM_PREFIX + "pool")
    d.mkdir(parents=True, exist_ok=True)
    yield d
    left = sorted(p.name for p in d.iterdir() if not p.name.startswith("."))  # .overlays
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"pool working directories left: {left}"


def make_pool(slot_pool: SlotPool, vms_dir: Path, *, size: int = 2,
              memory_mb: int = 4 * GUEST_MIB, busy: Callable[[], bool] = lambda: False
              ) -> VMMPool[NetworkSlot]:
    return VMMPool(QemuRuntime(), vms_dir, size=size, memory_mb=memory_mb,
                   acquire=lambda: asyncio.to_thread(slot_pool.acquire),
                   release=lambda slot: asyncio.to_thread(slot_pool.release, slot),
                   busy=busy, max_defer_s=0.5)


async def until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        await asyncio.sleep(0.05)


def live_pids(pool: VMMPool[NetworkSlot]) -> list[int]:
    return [e.pre.process.pid for q in pool._idle.values() for e in q]


async def run_taken(pool: VMMPool[NetworkSlot], template: Path,
                    check: Callable[[str], Awaitable[None]] | None = None) -> float:
    """Take a pooled VMM, activate it, see envd answer, stop it; the activation's seconds."""
    entry = await pool.take(template)
    assert entry is not None, "no pooled VMM to take"
    pre: Prestarted = entry.pre
    assert pre.is_alive()
    vm = await pool.runtime.activate(pre)
    try:
        url = Guest.envd_url(entry.slot.host_ip)
        await wait_for_envd(url, 60, vm=vm)
        async with httpx.AsyncClient() as c:
            assert (await c.get(url + "/health", timeout=5)).status_code == 204
        if check is not None:
            await check(url)
        return float(vm.boot_timings["activate"])
    finally:
        await vm.stop()
        await asyncio.to_thread(wd.remove, vm.workdir)
        await pool._release(entry.slot)


async def test_a_pooled_vmm_becomes_a_running_guest_by_loading_its_state(
        template, slot_pool, pool_dir) -> None:
    pool = make_pool(slot_pool, pool_dir)
    try:
        entry = await pool.fill_one(template)
        pre: Prestarted = entry.pre
        # It waits for its state: spawned, QMP up, memory mapped, vCPUs never started.
        status = await pre.qmp.execute("query-status")
        assert status["status"] == "inmigrate" and not status["running"]  # type: ignore[index]
        assert pre.workdir.parent == pool_dir and pre.vm_id.startswith(PREFIX)
        activate_s = await run_taken(pool, template)
        # Loading ~20 KiB of device state and starting the vCPUs, not a VMM start.
        assert activate_s < pre.timings["qmp_ready"] + pre.timings["prepare"] + 1.0
        assert pool.stats["hits"] == 1
    finally:
        await pool.close()


async def test_the_pool_refills_to_recent_demand_between_bursts_within_its_budget(
        template, slot_pool, pool_dir) -> None:
    starting = {"n": 0}
    pool = make_pool(slot_pool, pool_dir, size=3, busy=lambda: starting["n"] > 0)
    pool.start()
    try:
        assert await pool.take(template) is None  # a miss: no demand seen yet
        await until(lambda: pool.idle(template) == 1, what="one VMM after the first ask")
        # A burst of three asks within the window: the target becomes 3 (the size).
        starting["n"] = 1  # a start under way: the filler holds off for max_defer_s
        for _ in range(2):
            pool.note(template)
        await asyncio.sleep(0.2)
        assert pool.idle(template) == 1, "the filler worked during a start"
        starting["n"] = 0
        await until(lambda: pool.idle(template) == 3, what="refill to 3")
        await asyncio.sleep(0.5)
        assert pool.idle(template) == 3  # never beyond its size
        await run_taken(pool, template)
        await until(lambda: pool.idle(template) == 3, what="refill after a take")
    finally:
        await pool.close()
    assert pool.idle() == 0


async def test_the_pool_never_holds_more_guest_memory_than_its_budget(
        template, slot_pool, pool_dir) -> None:
    pool = make_pool(slot_pool, pool_dir, size=4, memory_mb=2 * GUEST_MIB + GUEST_MIB // 2)
    pool.start()
    try:
        for _ in range(6):
            pool.note(template)
        await until(lambda: pool.idle(template) == 2, what="two VMMs")
        await asyncio.sleep(1.0)
        assert pool.idle(template) == 2 and pool.held_mb() == 2 * GUEST_MIB
    finally:
        await pool.close()


async def test_a_pooled_vmm_killed_with_sigkill_is_discarded_and_the_next_take_works(
        template, slot_pool, pool_dir, caplog) -> None:
    pool = make_pool(slot_pool, pool_dir)
    try:
        first = await pool.fill_one(template)
        await pool.fill_one(template)
        os.kill(first.pre.process.pid, signal.SIGKILL)
        await until(lambda: not first.pre.is_alive(), 10, "the VMM to die")
        with caplog.at_level(logging.WARNING, logger="aenv.runtime"):
            await run_taken(pool, template)  # takes the live one, after discarding the dead
        assert pool.stats["dead"] == 1
        # how it ended is logged, with what its log says
        assert any(first.pre.vm_id in r.getMessage() and "killed by SIGKILL" in r.getMessage()
                   for r in caplog.records)
        assert not first.workdir.exists()
        # With none left the caller restores as usual.
        assert await pool.take(template) is None
    finally:
        await pool.close()


async def test_pooled_vmms_of_a_snapshot_that_went_away_are_discarded(
        template, slot_pool, pool_dir) -> None:
    pool = make_pool(slot_pool, pool_dir)
    moved = template.with_name("template-deleted")
    try:
        entries = [await pool.fill_one(template) for _ in range(2)]
        template.rename(moved)  # the template is deleted and its files collected
        try:
            assert await pool.prune() == 2
            assert pool.idle() == 0 and pool.target(template.resolve()) == 0
            assert not any(e.pre.is_alive() or e.workdir.exists() for e in entries)
        finally:
            moved.rename(template)
    finally:
        await pool.close()


async def test_close_ends_every_pooled_vmm_and_sweep_ends_those_a_crash_left(
        template, slot_pool, pool_dir) -> None:
    pool = make_pool(slot_pool, pool_dir)
    leased = slot_pool.stats()["leased"]
    await pool.fill_one(template)
    pids = live_pids(pool)
    await pool.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert slot_pool.stats()["leased"] == leased and not any(pool_dir.glob(PREFIX + "*"))

    # A crash: the server is gone, its pooled VMM waits on in its slot.
    crashed = make_pool(slot_pool, pool_dir)
    entry = await crashed.fill_one(template)
    pid = entry.pre.process.pid
    await entry.pre.qmp.disconnect()
    killed = await asyncio.to_thread(VMMPool.sweep, pool_dir)
    assert killed == [entry.workdir.name]
    await asyncio.wait_for(entry.pre.process.wait(), 10)  # reaped: our own child here
    assert not Path(f"/proc/{pid}").exists()
    # The next server removes the directory, the VMM's confinement and the slot as any
    # other leftovers; here by hand.
    await asyncio.to_thread(wd.remove, entry.workdir)
    await asyncio.to_thread(entry.pre.process.close)
    await asyncio.to_thread(slot_pool.release, entry.slot)


async def test_a_snapshot_wanted_once_gets_one_vmm_until_taken_or_its_time_is_up(
        template, slot_pool, pool_dir) -> None:
    """A paused sandbox's snapshot (``want_once``): one VMM, not made again once taken,
    discarded when its time is up; and only with memory the templates' demand leaves."""
    pool = make_pool(slot_pool, pool_dir, size=2, memory_mb=2 * GUEST_MIB)
    pool.start()
    try:
        pool.want_once(template, 30)
        await until(lambda: pool.idle(template) == 1, what="the one-shot VMM")
        await asyncio.sleep(0.5)
        assert pool.idle(template) == 1 and pool.target(template.resolve()) == 0
        await run_taken_once(pool, template)
        await asyncio.sleep(1.0)
        assert pool.idle(template) == 0, "a one-shot snapshot was pre-started again"
        # Its time runs out before anyone takes it: discarded.
        pool.want_once(template, 1.5)
        await until(lambda: pool.idle(template) == 1, what="the second one-shot VMM")
        await until(lambda: pool.idle(template) == 0, 10, "its expiry")
        assert pool.stats["discarded"] >= 1
    finally:
        await pool.close()


async def run_taken_once(pool: VMMPool[NetworkSlot], template: Path) -> None:
    entry = await pool.take(template, once=True)
    assert entry is not None
    vm = await pool.runtime.activate(entry.pre)
    try:
        await wait_for_envd(Guest.envd_url(entry.slot.host_ip), 60, vm=vm)
    finally:
        await vm.stop()
        await asyncio.to_thread(wd.remove, vm.workdir)
        await pool._release(entry.slot)


async def test_a_resume_waits_for_its_half_made_vmm_and_an_unwanted_one_is_discarded(
        template, slot_pool, pool_dir) -> None:
    pool = make_pool(slot_pool, pool_dir)  # no filler: fill_one is driven by hand
    key = template.resolve()
    try:
        pool.want_once(template, 30)
        making = asyncio.create_task(pool.fill_one(template))
        await asyncio.sleep(0)  # fill_one runs to its first await: counted as being made
        assert pool._making.get(key), making
        entry = await pool.take(template, once=True)  # waits for it rather than None
        assert entry is not None and entry is await making
        await pool.discard(entry)
        # Made for a snapshot nobody wants any more (its time ran out meanwhile): discarded.
        pool.want_once(template, 30)
        making = asyncio.create_task(pool.fill_one(template))
        await asyncio.sleep(0)
        assert pool._making.get(key), making
        pool._once.pop(key)
        with pytest.raises(VMError, match="no longer wanted"):
            await making
        assert pool.idle() == 0 and not list(pool_dir.glob(PREFIX + "*"))
    finally:
        await pool.close()
