"""Network slot latency: create and destroy one slot, and acquire from a warm pool.

Run as root: ``.venv/bin/python benchmarks/network_slots.py [--n 50]``. Prints one JSON
object (milliseconds). Uses its own name prefix and address ranges, so it does not disturb
a running aenv, and removes everything it made, also when interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.network import EgressPolicy, NetworkSlot, SlotPool, cleanup_leftovers, host
from aenv.network.addressing import Addressing
from benchmarks._common import emit, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--warm", type=int, default=2)
    # Own ranges, away from aenv's defaults; change them if another tool uses these.
    ap.add_argument("--host-cidr", default="10.97.0.0/24")
    ap.add_argument("--veth-cidr", default="10.97.1.0/24")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("network_slots.py needs root")
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="aenv-bench-")),
                        name_prefix=f"ab{os.getpid() % 10000:04d}",
                        host_cidr=args.host_cidr, veth_cidr=args.veth_cidr)
    a = Addressing(settings)
    create: list[float] = []
    destroy: list[float] = []
    acquire: list[float] = []
    acquire_policy: list[float] = []
    release: list[float] = []
    policy = EgressPolicy.build(allow_out=["192.168.0.0/16"], deny_out=["0.0.0.0/0"])
    try:
        host.prepare(a)
        for _ in range(args.n):
            t0 = time.perf_counter()
            slot = NetworkSlot.create(a, 1)
            t1 = time.perf_counter()
            slot.destroy()
            t2 = time.perf_counter()
            create.append((t1 - t0) * 1000)
            destroy.append((t2 - t1) * 1000)
        host.remove_table(a)

        with SlotPool(settings, warm_size=args.warm) as pool:
            for _ in range(args.n):
                pool.wait_warm(30)
                t0 = time.perf_counter()
                slot = pool.acquire()
                t1 = time.perf_counter()
                pool.release(slot)
                t2 = time.perf_counter()
                acquire.append((t1 - t0) * 1000)
                release.append((t2 - t1) * 1000)
                pool.wait_warm(30)
                t0 = time.perf_counter()
                slot = pool.acquire(policy)
                acquire_policy.append((time.perf_counter() - t0) * 1000)
                pool.release(slot)
    finally:
        cleanup_leftovers(settings)
    emit({
        "benchmark": "network_slots",
        "unit": "ms",
        "slot_create": summary(create),
        "slot_destroy": summary(destroy),
        "pool_acquire_warm": summary(acquire),
        "pool_acquire_warm_with_policy": summary(acquire_policy),
        "pool_release": summary(release),
        "warm_size": args.warm,
        "cpus": os.cpu_count(),
    })


if __name__ == "__main__":
    main()
