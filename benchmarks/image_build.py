"""Time guest kernel preparation and base image builds, cold and cached; print JSON.

Cold runs use a fresh, empty aenv home (so they include downloading the kernel package,
debootstrap's packages and envd's wheels from the registries); cached runs repeat the same
call on that home. With ``--boots N`` it also boots the fresh base image N times with the
plain QEMU harness of tests/guest and reports wall time to envd's /health and the guest's
phase markers. Needs root. The host has 2 shared cores: expect +-20 % between runs.

    .venv/bin/python benchmarks/image_build.py [--boots 3] [--flavor cloud|small] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.storage.images import ensure_base_image
from aenv.storage.kernel import ensure_kernel
from benchmarks._common import emit


def _timed(fn):
    t0 = time.monotonic()
    value = fn()
    return value, round(time.monotonic() - t0, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boots", type=int, default=0)
    parser.add_argument("--flavor", default="cloud", choices=["cloud", "small"])
    parser.add_argument("--keep", action="store_true", help="keep the temporary aenv home")
    parser.add_argument("--kernel-from", type=Path, default=None,
                        help="copy prepared kernels from this aenv home (the small kernel "
                             "takes ~8 min to build); kernel_cold_s is then a cache hit")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-"))
    settings = Settings(home=home)
    result: dict[str, object] = {"home": str(home), "flavor": args.flavor}
    try:
        if args.kernel_from:
            shutil.copytree(Settings(home=args.kernel_from).kernels_dir, settings.kernels_dir)
            result["kernel_copied_from"] = str(args.kernel_from)
        kernel, result["kernel_cold_s"] = _timed(lambda: ensure_kernel(settings, args.flavor))
        _, result["kernel_cached_s"] = _timed(lambda: ensure_kernel(settings, args.flavor))
        image, result["image_cold_s"] = _timed(
            lambda: ensure_base_image(settings, kernel_flavor=args.flavor)
        )
        _, result["image_cached_s"] = _timed(
            lambda: ensure_base_image(settings, kernel_flavor=args.flavor)
        )
        result["kernel"] = kernel.version
        result["image_digest"] = image.digest
        result["image_allocated_mb"] = round(image.path.stat().st_blocks * 512 / 1e6, 1)
        result["image_size_gib"] = round(image.size_bytes / (1 << 30), 2)
        if args.boots:
            result["boot"] = _boots(kernel, image, home, args.boots)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    emit(result)


def _boots(kernel, image, home: Path, n: int) -> dict[str, object]:
    from tests.guest.harness import boot

    walls, phases = [], []
    for _ in range(n):
        g = boot(kernel, image, home, cpus=2)
        try:
            walls.append(round(g.wait_health(timeout=120), 3))
            phases.append(g.phases())
        finally:
            g.stop()
    return {
        "to_envd_health_wall_s": walls,
        "median_s": round(statistics.median(walls), 3),
        "guest_uptime_phases": phases,
    }


if __name__ == "__main__":
    main()
