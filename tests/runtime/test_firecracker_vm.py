"""A real Firecracker guest: boot to envd, pause, snapshot, stop, restore into another slot.

This is the only test that proves a guest runs under the Firecracker driver. It needs a
``firecracker`` binary on PATH and hardware KVM (``aenv.runtime.kvm`` must choose ``kvm``:
a ``/dev/kvm`` served by kvm_pvm cannot run the stock guest kernel), plus root for the
network slots. Where either is missing it is skipped with the reason; the API-contract tests
in ``test_firecracker_driver.py`` run everywhere.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from aenv.guest.bootargs import guest_boot_args
from aenv.runtime import Drive, RestoreOverrides, VMSpec
from aenv.runtime import workdir as wd
from aenv.runtime.firecracker import FirecrackerRuntime, FirecrackerVM
from aenv.runtime.kvm import host_accel
from aenv.runtime.ready import boot_until_ready, wait_for_envd
from aenv.storage import snapshots
from aenv.storage.disks import create_disk
from tests.runtime.conftest import VM_PREFIX, Guest


def firecracker_missing() -> str | None:
    """Why a real Firecracker guest cannot run here, or None."""
    if shutil.which("firecracker") is None:
        return "no firecracker binary on PATH"
    choice = host_accel()
    if choice.accel != "kvm":
        return f"Firecracker needs hardware KVM: {choice.reason}"
    return None


pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(firecracker_missing() is not None, reason=str(firecracker_missing())),
]


async def test_a_real_firecracker_guest_boots_pauses_snapshots_and_restores_elsewhere(
        rt_settings, kernel, base_image, slot_pool) -> None:
    runtime = FirecrackerRuntime()
    vms: list[FirecrackerVM] = []
    slots = []
    workdirs = [rt_settings.vms_dir / f"{VM_PREFIX}fc-a", rt_settings.vms_dir / f"{VM_PREFIX}fc-b"]
    snap = rt_settings.vms_dir / f"{VM_PREFIX}fc-snap"
    try:
        slots.append(await asyncio.to_thread(slot_pool.acquire))
        workdirs[0].mkdir(parents=True)
        disk = create_disk(base_image.path, workdirs[0])
        if disk.format != "raw":  # no reflink here: Firecracker needs a raw file
            disk.path.unlink()
            snapshots.copy_sparse(base_image.path, workdirs[0] / "rootfs.raw")
        spec = VMSpec(
            vm_id="fc-a", workdir=workdirs[0], kernel=kernel.vmlinux, initrd=kernel.initrd,
            boot_args=guest_boot_args(kernel), memory_mib=512,
            drives=(Drive("rootfs", workdirs[0] / "rootfs.raw"),),
            tap=slots[0].tap_name, netns=slots[0].netns, mac=slots[0].guest_mac,
        )
        vm, phases = await boot_until_ready(runtime, spec, Guest.envd_url(slots[0].host_ip))
        vms.append(vm)
        assert phases.total < 30
        await vm.pause()
        await vm.snapshot(snap)
        await vm.stop()

        slots.append(await asyncio.to_thread(slot_pool.acquire))
        clone = await runtime.restore(snap, RestoreOverrides(
            "fc-b", workdirs[1], tap=slots[1].tap_name, netns=slots[1].netns))
        vms.append(clone)
        await wait_for_envd(Guest.envd_url(slots[1].host_ip), 30, vm=clone)
        assert await clone.status() == "Running"
    finally:
        for v in vms:
            if v.is_alive():
                await v.stop()
        for w in workdirs:
            wd.remove(w)
        snapshots.remove(snap)
        for s in slots:
            await asyncio.to_thread(slot_pool.release, s)
