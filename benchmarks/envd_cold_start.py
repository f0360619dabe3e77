"""envd cold start: spawn ``python -m aenv.envd`` until ``GET /health`` first answers 204.

Run: ``.venv/bin/python benchmarks/envd_cold_start.py [--n 20]``. Prints one JSON object
(milliseconds) with, beside the total, the floors it contains: a bare interpreter start and
importing envd's app module, each timed as its own process (warm page cache). /health is
polled every 2 ms, so the total is up to 2 ms late.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, emit, free_port, spawn_envd, stop, summary, wait_healthy


def time_process(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True)
    return (time.perf_counter() - started) * 1000


def time_cold_start() -> float:
    port = free_port()
    started = time.perf_counter()
    proc = spawn_envd(port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        return (time.perf_counter() - started) * 1000
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()

    time_cold_start()  # warm the page cache; not counted
    total = [time_cold_start() for _ in range(args.n)]
    bare = [time_process([sys.executable, "-c", "pass"]) for _ in range(args.n)]
    imports = [time_process([sys.executable, "-c", "import aenv.envd.app"])
               for _ in range(args.n)]
    emit({
        "benchmark": "envd_cold_start",
        "python": sys.version.split()[0],
        "spawn_to_first_health_204_ms": summary(total),
        "floor_python_start_ms": summary(bare),
        "floor_python_start_and_import_app_ms": summary(imports),
    })


if __name__ == "__main__":
    main()
