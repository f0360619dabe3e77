"""Pull + unpack of a ~100 MB image from a local docker-registry, cold and warm.

Each run pulls the image (four ~25 MB gzip layers of random bytes, so the MB are real
transfer) into the blob cache and applies its layers into a fresh tree. Cold runs start
with an empty cache; warm runs reuse it (a tag: one manifest request, no blob bytes).
Prints one JSON object: p50/p99 wall ms per phase, MB/s of the cold pull, bytes
transferred. ``prepare`` is the template builder's own path (``RegistryImages.prepare``:
the pull, then the layers unpacked and the ext4 image written with the tools user), cold in
a fresh home and warm in the same one, where the image is found by its digest. Needs
docker-registry and skopeo (scripts/setup.sh), and root for the unpack (ownership).
Usage: python benchmarks/image_pull.py [--runs N]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.from_image import ImageRequest, RegistryImages
from aenv.storage import tar_layers
from aenv.storage.registry import pull_image
from aenv.storage.registry_ref import parse_reference
from benchmarks._common import emit, percentile, summary
from tests.registries import Registry, oci_layout, tar_layer


def _run(settings: Settings, ref: str, scratch: Path) -> dict[str, float]:
    tree = scratch / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir()
    t0 = time.monotonic()
    with pull_image(settings, ref) as image:
        t1 = time.monotonic()
        for layer in image.layers:
            tar_layers.apply_layer(tree, layer, whiteouts=True)
        t2 = time.monotonic()
    return {"pull_ms": (t1 - t0) * 1e3, "unpack_ms": (t2 - t1) * 1e3,
            "total_ms": (t2 - t0) * 1e3, "bytes": float(image.bytes_transferred)}


def _prepare(settings: Settings, ref: str) -> dict[str, float]:
    lines: list[str] = []
    t0 = time.monotonic()
    RegistryImages(settings).prepare(ImageRequest(parse_reference(ref)), lines.append)
    ms = (time.monotonic() - t0) * 1e3
    (mb,) = [float(line.split(", ")[-1].split()[0]) for line in lines
             if line.startswith("pulled ")]
    return {"prepare_ms": ms, "bytes": mb * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-pull-"))
    registry = Registry(work / "registry")
    try:
        rng = random.Random(17)
        layers = [(tar_layer({f"data/{i}.bin": rng.randbytes(25 << 20)}), "gzip")
                  for i in range(4)]
        size = sum(len(d) for d, _ in layers)
        ref = registry.push(oci_layout(work / "layout", layers), "bench/big")
        print(f"pushed {size / 1e6:.1f} MB as {ref}", file=sys.stderr)
        cold, warm = [], []
        prepare_cold: list[dict[str, float]] = []
        prepare_warm: list[dict[str, float]] = []
        for i in range(args.runs):
            settings = Settings(home=work / f"home-{i}")
            cold.append(_run(settings, ref, work))
            warm.append(_run(settings, ref, work))
            shutil.rmtree(settings.home)
            settings = Settings(home=work / f"home-{i}-prepare")
            prepare_cold.append(_prepare(settings, ref))
            prepare_warm.append(_prepare(settings, ref))
            shutil.rmtree(settings.home)
        emit({
            "image_mb": round(size / 1e6, 1), "runs": args.runs,
            "cold": {k: summary([r[k] for r in cold]) for k in ("pull_ms", "unpack_ms",
                                                                 "total_ms")},
            "warm": {k: summary([r[k] for r in warm]) for k in ("pull_ms", "unpack_ms",
                                                                 "total_ms")},
            "cold_pull_mb_s": round(size / 1e6 / (sorted(r["pull_ms"] for r in cold)
                                                  [len(cold) // 2] / 1e3), 1),
            "cold_bytes_transferred": [int(r["bytes"]) for r in cold],
            "warm_bytes_transferred": [int(r["bytes"]) for r in warm],
            "prepare_cold_ms": summary([r["prepare_ms"] for r in prepare_cold]),
            "prepare_warm_ms": summary([r["prepare_ms"] for r in prepare_warm]),
            "prepare_warm_pct_of_cold": round(
                100 * percentile([r["prepare_ms"] for r in prepare_warm], 50)
                / percentile([r["prepare_ms"] for r in prepare_cold], 50), 1),
            "prepare_warm_mb_transferred": [r["bytes"] / 1e6 for r in prepare_warm],
        })
    finally:
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
