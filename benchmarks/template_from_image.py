"""From a never-seen registry image to the first ``commands.run`` answered, through E2B's SDK.

Run as root: ``.venv/bin/python benchmarks/template_from_image.py [--runs 2] [--mb 100]
[--creates 10]``. Starts its own ``aenv server`` (own home, shared cache for the kernel and
base image) and a ``docker-registry`` on loopback. Each run pushes a new image: the static
busybox of ``tests/local_registry.py`` plus a layer of ``--mb`` MB of random bytes (so no
blob is cached), builds a template from it with ``Template().from_image``, creates a sandbox
and runs one command. Phases come from the build log's timestamps (see ``MARKS``): pull
(manifest, config and blobs fetched and verified), image (layers unpacked, ext4 written),
boot (cold boot of the build VM to envd), snapshot (the step, sync and the template's
snapshot), sdk (the SDK noticing the build finished), then create and the first command. A
second build of the same image (another template name) gives the warm figures: MB
transferred, and its time as a share of the cold build's (the whole build, and pull + image
alone). Then ``--creates`` creates of a template on the busybox image (no Python) and of
``base``, alternating. The run's random images and blobs are removed from the shared cache
at the end. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.storage import images
from benchmarks._common import emit, summary
from benchmarks._server import VMServer, log
from tests.local_registry import busybox_layout, local_registry

# Build-log lines that end each phase (the server's timestamps): the pull (manifest, config
# and blobs fetched and verified), the image (layers unpacked, the tools user added, ext4
# written; absent on a warm rebuild, whose image is a cache hit), the build VM's cold boot
# to envd (ends when the first step starts), the step, sync and the template's snapshot.
MARKS = {"pull": "pulled sha256:", "image": "starting from template", "boot": "RUN ",
         "snapshot": "build finished"}
TRANSFERRED = re.compile(r"pulled (sha256:[0-9a-f]+): \d+ layers, ([0-9.]+) MB transferred")


def big_image(base: Path, work: Path, mb: int) -> Path:
    """``base`` plus one layer of ``mb`` MB of fresh random bytes, as a new OCI layout."""
    layout = work / f"big-{uuid.uuid4().hex[:8]}"
    subprocess.run(["cp", "-a", str(base), str(layout)], check=True)
    bundle = work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    subprocess.run(["umoci", "--log", "error", "unpack", "--image", f"{layout}:latest",
                    str(bundle)], check=True, capture_output=True)
    with open(bundle / "rootfs/srv/payload", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    subprocess.run(["umoci", "--log", "error", "repack", "--image", f"{layout}:latest",
                    str(bundle)], check=True)
    shutil.rmtree(bundle)
    return layout


def build(image: str) -> tuple[str, dict[str, float]]:
    """Build a template from ``image``: (name, figures): seconds per phase (each from the
    previous mark; ``sdk`` is the SDK's polling after the server finished), ``built`` (the
    SDK's wall time), ``mb_transferred`` and the image's manifest ``digest``."""
    from e2b import Template

    name = f"bench-img-{uuid.uuid4().hex[:8]}"
    at: dict[str, float] = {}
    info: dict[str, Any] = {}
    t0 = time.time()

    def on_log(entry: Any) -> None:
        ts = entry.timestamp.timestamp() if isinstance(entry.timestamp, datetime) \
            else time.time()
        for phase, text in MARKS.items():
            if phase not in at and text in entry.message:
                at[phase] = ts - t0
        if m := TRANSFERRED.search(entry.message):
            info["digest"], info["mb_transferred"] = m.group(1), float(m.group(2))
    Template.build(Template().from_image(image).run_cmd("true"), name, on_build_logs=on_log)
    built = time.time() - t0
    figures: dict[str, Any] = {}
    previous = 0.0
    for phase in MARKS:
        figures[phase] = round(at[phase] - previous, 2)
        previous = at[phase]
    figures["sdk"] = round(built - previous, 2)
    figures["built"] = round(built, 2)
    return name, {**figures, **info}


def first_command(name: str) -> tuple[float, float]:
    """(seconds to ``Sandbox.create``, seconds to the first ``commands.run`` answered)."""
    from e2b import Sandbox

    t = time.monotonic()
    sbx = Sandbox.create(name)
    created = time.monotonic() - t
    sbx.commands.run("true")
    answered = time.monotonic() - t
    sbx.kill()
    return created, answered


def forget(settings: Settings, digests: set[str], blobs: set[str]) -> None:
    """Remove the benchmark's own images (built from ``digests``) and pulled ``blobs`` from
    the shared cache: each run's are random, so no one else will use them."""
    for manifest in settings.images_dir.glob(f"*/{images.MANIFEST}"):
        try:
            source = json.loads(manifest.read_text()).get("source", "")
        except (OSError, ValueError):
            continue
        if source.removeprefix("oci ") in digests:
            shutil.rmtree(manifest.parent, ignore_errors=True)
    for digest in blobs:
        (settings.registry_blobs_dir / "sha256" / digest.removeprefix("sha256:")).unlink(
            missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--creates", type=int, default=10)
    args = ap.parse_args()
    shared = Settings.from_env()
    digests: set[str] = set()
    blobs: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="aenv-bench-img-") as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        srv = VMServer(work / "home", 63, shared.artifacts)
        srv.start()
        api_key = (srv.settings.secrets_dir / "api-key").read_text().strip()
        os.environ.update({"E2B_API_KEY": api_key, "E2B_API_URL": srv.url,
                           "E2B_SANDBOX_URL": srv.url})
        os.environ.pop("E2B_DOMAIN", None)
        try:
            with local_registry(work / "registry") as reg:
                base = busybox_layout(shared.cache_dir)
                cold, warm = [], []
                for i in range(args.runs):
                    layout = big_image(base, work, args.mb)
                    blobs |= {f"sha256:{p.name}" for p in (layout / "blobs/sha256").iterdir()}
                    ref = reg.push(layout, f"big{i}:1")
                    name, times = build(ref)
                    digests.add(times["digest"])
                    created, answered = first_command(name)
                    times["create"], times["first_command"] = round(created, 2), round(
                        answered - created, 2)
                    times["total"] = round(times["built"] + answered, 2)
                    cold.append(times)
                    log(f"cold {i}: {times}")
                    _, again = build(ref)
                    again["pct_of_cold_build"] = round(100 * again["built"] / times["built"], 1)
                    again["pull_and_image_pct"] = round(
                        100 * (again["pull"] + again["image"])
                        / (times["pull"] + times["image"]), 1)
                    warm.append(again)
                    log(f"warm {i}: {again}")
                blobs -= {f"sha256:{p.name}" for p in (base / "blobs/sha256").iterdir()}
                small = reg.push(base, "bb:1")
                small_tpl, _ = build(small)
                creates: dict[str, list[float]] = {"image": [], "base": []}
                for _ in range(args.creates):
                    for which, tpl in (("image", small_tpl), ("base", "base")):
                        creates[which].append(first_command(tpl)[0] * 1000)
        finally:
            srv.kill_all()
            srv.stop()
            forget(shared, digests, blobs)
    create_ms = {k: summary(v) for k, v in creates.items()}
    emit({"benchmark": "template_from_image", "image_mb": args.mb, "runs": args.runs,
          "cold_s": cold, "warm_s": warm, "create_ms": create_ms,
          "create_p50_image_vs_base_pct": round(
              100 * create_ms["image"]["p50"] / create_ms["base"]["p50"] - 100, 1)})


if __name__ == "__main__":
    main()
