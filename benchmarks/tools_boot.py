"""Cold boot to envd ``/health`` of an image on the tools drive vs the ``base`` image.

Run as root: ``.venv/bin/python benchmarks/tools_boot.py [--runs 5] [--image NAME]``. Boots,
alternately, the ``base`` image (envd in the image) and a tools image (envd from the shared
read-only tools drive; default: the static busybox image of ``tests/guest/tools_images``,
built on first use) under the qemu driver in a real network slot, with the cloud kernel,
and prints one JSON object with the p50 of each phase (seconds, as ``vm_boot.py`` splits a
boot at the console markers) for both. Own name prefix and address ranges; every VM, disk
and slot it made is removed, also when a boot fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.network import SlotPool
from aenv.runtime.kvm import host_accel
from aenv.storage.images import Image, build_image, ensure_base_image, find_image
from aenv.storage.kernel import ensure_kernel
from aenv.storage.tools_drive import ensure_tools_drive
from benchmarks._common import emit, private_settings
from benchmarks.vm_boot import boot_once

PHASES = ("vmm_to_qmp", "kernel_to_init", "init_to_envd_exec", "envd_exec_to_health", "total")


def tools_image(settings: Settings, name: str | None) -> Image:
    if name:
        image = find_image(settings, name)
        if not image.uses_tools:
            sys.exit(f"{name} does not boot with the tools drive")
        return image
    from tests.guest.tools_images import busybox_tree

    with tempfile.TemporaryDirectory(dir=settings.cache_dir) as tmp:
        tree = busybox_tree(settings, Path(tmp) / "busybox")
        return build_image(settings, "aenvtd-busybox", tree, guest_layer="tools")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--image", help="a built tools image (default: the busybox test image)")
    ap.add_argument("--memory-mib", type=int, default=512)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("tools_boot.py needs root (network namespaces and taps)")
    settings = private_settings("at", 96)
    kernel = ensure_kernel(settings, "cloud")
    images = {"base": (ensure_base_image(settings, kernel_flavor="cloud"), None)}
    drive = ensure_tools_drive(settings)
    tools = tools_image(settings, args.image)
    images[tools.name] = (tools, drive.path)
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in images}
    pool = SlotPool(settings, warm_size=1)
    await asyncio.to_thread(pool.start)
    try:
        for i in range(args.runs):
            for key, (image, tools_path) in images.items():
                phases = await boot_once(settings, pool, kernel, image, f"bench-{key}-{i}",
                                         args.memory_mib, tools=tools_path)
                samples[key].append({p: round(getattr(phases, p), 3) for p in PHASES})
                print(f"{key} run {i + 1}/{args.runs}: {samples[key][-1]['total']:.2f} s",
                      file=sys.stderr)
    finally:
        await asyncio.to_thread(pool.close)
    emit({
        "benchmark": "tools_boot",
        "runtime": "qemu",
        "accel": host_accel().accel,
        "runs": args.runs,
        "kernel": kernel.version,
        "tools_drive": {"digest": drive.digest[:12], "size_bytes": drive.size_bytes},
        "note": "2 shared host cores: expect +-20% between runs",
        "images": {key: {
            "image": images[key][0].digest[:12],
            "p50": {p: round(statistics.median(s[p] for s in runs), 3) for p in PHASES},
            "samples": runs,
        } for key, runs in samples.items()},
    })


if __name__ == "__main__":
    asyncio.run(main())
