"""VM boot latency: VMM spawn to envd ``/health`` 204, split into phases, p50 of N boots.

Run as root: ``.venv/bin/python benchmarks/vm_boot.py [--runs 5] [--flavor cloud]``. Boots
the ``base`` image under the qemu driver in a real network slot, once per run, for each
kernel flavor available (``cloud`` always; ``small`` when it has been built), and prints
one JSON object (seconds). Phases: ``vmm_to_qmp`` (spawn -> QMP answers), ``kernel_to_init``
(-> first init marker on the console), ``init_to_envd_exec`` (-> init execs envd),
``envd_exec_to_health`` (-> /health 204). Kernels and images come from the data dir
(``AENV_HOME``) and are built there on first use. It uses its own name prefix and address
ranges and removes every VM, disk and slot it made, also when a boot fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.guest.bootargs import guest_boot_args
from aenv.network import SlotPool
from aenv.runtime import Drive, VMSpec, get_runtime
from aenv.runtime import workdir as wd
from aenv.runtime.kvm import host_accel
from aenv.runtime.ready import BootPhases, boot_until_ready
from aenv.storage.disks import create_disk
from aenv.storage.images import ensure_base_image
from aenv.storage.kernel import ensure_kernel, list_kernels
from benchmarks._common import emit

PHASES = ("vmm_to_qmp", "kernel_to_init", "init_to_envd_exec", "envd_exec_to_health", "total")
GOAL_S = 3.0  # boot to envd ready under TCG with the packaged kernel


async def boot_once(settings: Settings, pool: SlotPool, kernel, image, name: str,
                    memory_mib: int) -> BootPhases:
    slot = await asyncio.to_thread(pool.acquire)
    workdir = settings.vms_dir / name
    try:
        disk = create_disk(image.path, workdir)
        spec = VMSpec(
            vm_id=name, workdir=workdir, kernel=kernel.vmlinux, initrd=kernel.initrd,
            boot_args=guest_boot_args(kernel), memory_mib=memory_mib,
            drives=(Drive("rootfs", disk.path, format=disk.format),),
            tap=slot.tap_name, netns=slot.netns, mac=slot.guest_mac,
            memory_file=wd.default_memory_file(name, workdir, settings.name_prefix),
        )
        vm, phases = await boot_until_ready(get_runtime("qemu"), spec,
                                            f"http://{slot.host_ip}:49983")
        await vm.stop()
        return phases
    finally:
        wd.remove(workdir)
        await asyncio.to_thread(pool.release, slot)


async def bench_flavor(settings: Settings, pool: SlotPool, flavor: str, runs: int,
                       memory_mib: int) -> dict[str, object]:
    kernel = ensure_kernel(settings, flavor)
    image = ensure_base_image(settings, kernel_flavor=flavor)
    samples = []
    for i in range(runs):
        phases = await boot_once(settings, pool, kernel, image, f"bench-{flavor}-{i}", memory_mib)
        samples.append({p: round(getattr(phases, p), 3) for p in PHASES})
        print(f"{flavor} run {i + 1}/{runs}: {samples[-1]['total']:.2f} s", file=sys.stderr)
    p50 = {p: round(statistics.median(s[p] for s in samples), 3) for p in PHASES}
    return {"kernel": kernel.version, "image": image.digest[:12], "p50": p50,
            "min_total": min(s["total"] for s in samples), "samples": samples}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--flavor", action="append", help="kernel flavor (default: all built)")
    ap.add_argument("--memory-mib", type=int, default=512)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("vm_boot.py needs root (network namespaces and taps)")
    settings = dataclasses.replace(
        Settings.from_env(), name_prefix=f"ab{os.getpid() % 10000:04d}",
        host_cidr="10.98.0.0/24", veth_cidr="10.98.1.0/24", warm_slots=1,
    )
    flavors = args.flavor or ["cloud", *sorted(
        {k.flavor for k in list_kernels(settings)} - {"cloud"})]
    accel = host_accel()
    pool = SlotPool(settings, warm_size=1)
    pool.start()
    try:
        results = {f: await bench_flavor(settings, pool, f, args.runs, args.memory_mib)
                   for f in flavors}
    finally:
        await asyncio.to_thread(pool.close)
    emit({
        "benchmark": "vm_boot",
        "runtime": "qemu",
        "accel": accel.accel,
        "accel_reason": accel.reason,
        "runs": args.runs,
        "memory_mib": args.memory_mib,
        "goal_total_s": GOAL_S,
        "note": "2 shared host cores: expect +-20% between runs",
        "flavors": results,
    })


if __name__ == "__main__":
    asyncio.run(main())
