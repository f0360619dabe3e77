"""Confined VMMs on real guests (``aenv.runtime.confine``): each QEMU runs as its own
unprivileged uid under seccomp, chrooted into its working directory, inside a cgroup whose
limits come from the VM's size; a guest cannot push its VMM past ``memory.max`` and a VMM
that goes over is killed alone; snapshot, restore and re-attach work confined, and stopping
a VM removes its cgroup and frees its uid.

Two VMs for the module: ``plain`` (default limits) and ``tight`` (a memory limit below its
guest RAM, so that the guest can reach it). Every assertion here fails on a driver that
starts QEMU as root without a jail.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from aenv.runtime import VMLimits
from aenv.runtime import confine as cf
from aenv.runtime import workdir as wd
from aenv.runtime.qemu import TCG_TB_MIB, QemuRuntime
from aenv.storage import snapshots
from tests.runtime.conftest import (
    GUEST_MIB,
    VM_PREFIX,
    Guest,
    destroy_guest,
    restore_guest,
    running_guest,
)

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]

TIGHT = 448 << 20  # below the tight guest's RAM: its guest can fill it
# Fill guest RAM in 8 MiB steps until the guest's OOM killer ends it.
HOG = ("python3 -c 'exec(\"l=[]\\nwhile 1: l.append(bytes([1])*(8<<20))\")' "
       ">/dev/null 2>&1; echo done")


def status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


@pytest.fixture(scope="module")
async def plain(rt_settings, kernel, base_image, slot_pool) -> AsyncIterator[Guest]:
    async with running_guest(VM_PREFIX + "c-plain", rt_settings, kernel, base_image,
                             slot_pool) as g:
        yield g


@pytest.fixture(scope="module")
async def tight(rt_settings, kernel, base_image, slot_pool) -> AsyncIterator[Guest]:
    async with running_guest(VM_PREFIX + "c-tight", rt_settings, kernel, base_image, slot_pool,
                             limits=VMLimits(memory_bytes=TIGHT)) as g:
        yield g


def test_the_vmm_runs_as_its_own_unprivileged_uid_under_seccomp_in_its_workdir(
        plain: Guest) -> None:
    vm = plain.vm
    st = status(vm.pid)
    uid = vm.jail.uid
    assert uid is not None and uid >= cf.UID_BASE
    gid = str(cf.VMM_GID)
    assert st["Uid"].split() == [str(uid)] * 4 and st["Gid"].split() == [gid] * 4
    assert st["Groups"].split() == [gid]
    assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0
    assert st["Seccomp"] == "2" and st["NoNewPrivs"] == "1"
    # chrooted into its working directory: it can name nothing else on the host
    assert os.readlink(f"/proc/{vm.pid}/root") == str(vm.workdir.resolve())
    assert os.readlink(f"/proc/{vm.pid}/cwd") == str(vm.workdir.resolve())
    # guest RAM stays root's (QEMU opened it before it dropped root)
    ram = (vm.workdir / wd.MEMORY).resolve()
    assert os.stat(ram).st_uid == 0


def test_two_vmms_have_different_uids_and_cannot_signal_each_other(plain: Guest,
                                                                  tight: Guest) -> None:
    a, b = plain.vm, tight.vm
    assert a.jail.uid != b.jail.uid
    # what a compromised VMM A could do to B: nothing, B is another user and not dumpable
    out = subprocess.run(["setpriv", f"--reuid={a.jail.uid}", f"--regid={a.jail.gid}",
                          "--clear-groups", "kill", "-0", str(b.pid)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "not permitted" in out.stderr.lower()


def test_the_vmm_is_in_its_cgroup_with_limits_from_the_vm_size(plain: Guest) -> None:
    vm = plain.vm
    cg = vm.jail.cgroup
    assert cg is not None and cg.contains(vm.pid)
    tb = TCG_TB_MIB if vm.accel == "tcg" else None
    want = cf.limits_for(1, GUEST_MIB, tcg_tb_mib=tb)
    assert vm.jail.limits == want
    assert cg.memory_stats()["limit"] == want.memory_max
    assert cg.read("pids.max") == str(want.pids_max)
    cpu = cg.read("cpu.max") or f"{cg.read('cpu.cfs_quota_us')} {cg.read('cpu.cfs_period_us')}"
    assert cpu == f"{want.cpu_quota_us} {want.cpu_period_us}"
    # every thread of the VMM is in it, far below its task limit
    assert int(status(vm.pid)["Threads"]) < want.pids_max


def test_a_guest_that_allocates_past_its_ram_stays_within_memory_max(plain: Guest) -> None:
    vm = plain.vm
    sbx = plain.sandbox()
    assert sbx.commands.run(HOG, timeout=180).stdout.strip() == "done"
    stats = vm.jail.cgroup.memory_stats()
    # the guest's own OOM killer ended the hog; the VMM was never near its limit
    assert vm.is_alive() and stats["oom_kills"] == 0
    assert stats.get("peak", stats["current"]) <= stats["limit"]
    assert stats.get("peak", stats["current"]) > (GUEST_MIB << 20) // 2  # it did fill RAM
    assert sbx.commands.run("echo alive").stdout == "alive\n"


async def test_a_vmm_over_its_memory_max_is_killed_alone(plain: Guest, tight: Guest) -> None:
    before = plain.vm.jail.cgroup.memory_stats()
    tight.sandbox().commands.run(HOG, background=True)
    deadline = time.monotonic() + 180
    while tight.vm.is_alive():
        assert time.monotonic() < deadline, tight.vm.jail.cgroup.memory_stats()
        await asyncio.sleep(0.5)
    stats = tight.vm.jail.cgroup.memory_stats()
    assert stats["oom_kills"] >= 1 and stats["limit"] == TIGHT
    assert stats.get("peak", 0) <= TIGHT
    # the other VM did not notice
    assert plain.vm.is_alive()
    assert plain.vm.jail.cgroup.memory_stats()["oom_kills"] == before["oom_kills"] == 0
    assert httpx.get(plain.url + "/health", timeout=10).status_code == 204


async def test_snapshot_restore_and_reattach_work_confined_and_stop_releases(
        plain: Guest, rt_settings, slot_pool, tmp_path) -> None:
    sbx = plain.sandbox()
    sbx.files.write("/home/user/confined.txt", "written by a confined VM\n")
    snap = tmp_path / "running"
    await plain.vm.snapshot(snap)
    assert plain.vm.is_alive()
    # what the snapshot holds is root's; what the VM writes on is the VM's uid's
    for name in (snapshots.DEVICE_STATE, "rootfs.qcow2"):
        st = os.stat(snap / name)
        assert st.st_uid == 0 and not st.st_mode & stat.S_IWOTH, name
    top = plain.vm.active_drive("rootfs")
    assert os.stat(top).st_uid == plain.vm.jail.uid and stat.S_IMODE(os.stat(top).st_mode) == 0o600
    sbx.files.write("/home/user/after.txt", "after the snapshot\n")

    child = await restore_guest(VM_PREFIX + "c-child", snap, rt_settings, slot_pool,
                                plain.token)
    try:
        vm = child.vm
        st = status(vm.pid)
        assert vm.jail.uid not in (None, plain.vm.jail.uid)
        assert st["Uid"].split()[0] == str(vm.jail.uid) and st["Seccomp"] == "2"
        assert vm.jail.cgroup is not None and vm.jail.cgroup.contains(vm.pid)
        c = child.sandbox()
        assert c.files.read("/home/user/confined.txt") == "written by a confined VM\n"
        assert not c.files.exists("/home/user/after.txt")
        # a restored, confined VM snapshots again (fd-passed device state, diff memory)
        info = await vm.snapshot(tmp_path / "of-child")
        assert info.parent == snap

        # a server restart: the new handle knows the jail from the manifest
        await vm.detach()
        again = await QemuRuntime().attach(vm.workdir)
        child.old_handles.append(vm)
        child.vm = again
        assert again.jail == vm.jail and not again.jail.released
        cg, uid, ids = again.jail.cgroup, again.jail.uid, again.jail.ids_dir
        await again.stop()
        assert not cg.exists() and not (ids / str(uid)).exists()
    finally:
        await destroy_guest(child, slot_pool)
