"""Creates per second through one ``aenv gateway`` over two nodes vs one node directly
(issue 18's measure; goal: >= 1.8x with two nodes when the nodes, not the gateway, are
the limit).

``.venv/bin/python benchmarks/cluster_create_rate.py [--creates 200] [--concurrency 16]
[--slots 2] [--start-ms 100] [--rounds 2]``

Method: a real ``redis-server``; two nodes, each the real ``aenv.server.Server`` (REST
API, orchestrator, SQLite store, node agent publishing after every create) in its own
child process, joined to the cluster; and a real ``aenv gateway`` in another child. A
node's machines start no VM: a start takes one of ``--slots`` boot slots for
``--start-ms`` (a sleep), so each node does at most slots / start time creates per
second whatever the host's CPUs do (on this 2-core TCG host, real VMs on two nodes share
the same two CPUs and the ratio would measure the host). ``AENV_MAX_STARTING`` is high
enough that nodes queue rather than refuse. ``--concurrency`` clients (asyncio, httpx)
send ``POST /sandboxes`` until ``--creates`` are made; the rate is creates / wall time.
Sandboxes are killed after each phase, untimed. Per round:

- ``direct_one_node``: to node 1 with its own API key;
- ``gateway_two_nodes``: to the gateway, which spreads them over both nodes.

After the rounds, node 2 is drained (``POST /node/drain``) and ``gateway_one_node``
measures the gateway over node 1 alone: what the gateway costs at the same node limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import free_port, spawn_child, summary
from benchmarks._servers import finish, start_gateway, start_redis, wind_down

SECRET = "bench-cluster-secret-" + "2" * 24
KEY = "e2b_" + "5" * 40


def serve(home: Path, port: int, redis_url: str, node_id: str, slots: int,
          start_ms: float) -> None:
    """A node (child process): aenv's Server whose starts take a boot slot for a while."""
    import uvicorn

    from aenv.config import Settings
    from aenv.orchestrator.machine import Placement
    from aenv.server import Server, ServerOptions
    from aenv.store import SandboxRecord, TemplateRecord
    from tests.deploy.test_drain import IdleMachines

    class BusyMachines(IdleMachines):
        def __init__(self) -> None:
            super().__init__()
            self.slots: asyncio.Semaphore | None = None

        async def start(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
            if self.slots is None:
                self.slots = asyncio.Semaphore(slots)
            async with self.slots:
                await asyncio.sleep(start_ms / 1000)
            return await super().start(rec, template)

    settings = Settings(home=home, listen_port=port, cluster=redis_url, node_id=node_id,
                        cluster_secret=SECRET, advertise_url=f"http://127.0.0.1:{port}",
                        max_starting=1000, max_sandboxes=100_000)
    srv = Server(settings, BusyMachines(), ServerOptions.from_settings(settings))
    now = time.time()
    srv.templates.insert(TemplateRecord(
        id="base", kind="template", build_id="b0", status="ready", cpu_count=1,
        memory_mb=256, disk_size_mb=512, created_at=now, updated_at=now, names=["base"]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(srv.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                lifespan="on")


async def create_many(url: str, key: str, creates: int, concurrency: int
                      ) -> tuple[float, list[str], list[float]]:
    """(creates per second, ids, per-create ms)."""
    ids: list[str] = []
    ms: list[float] = []
    left = creates
    async with httpx.AsyncClient(base_url=url, headers={"X-API-KEY": key}, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                r = await c.post("/sandboxes", json={"templateID": "base", "timeout": 600})
                r.raise_for_status()
                ms.append((time.perf_counter() - t0) * 1000)
                ids.append(r.json()["sandboxID"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return creates / wall, ids, ms


async def kill_all(url: str, key: str, ids: list[str]) -> None:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-KEY": key}, timeout=60) as c:
        sem = asyncio.Semaphore(16)

        async def one(i: str) -> None:
            async with sem:
                (await c.delete(f"/sandboxes/{i}")).raise_for_status()

        await asyncio.gather(*(one(i) for i in ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--creates", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2, help="a node's boot slots")
    ap.add_argument("--start-ms", type=float, default=100.0, help="one start's time")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        home, port, redis_url, node_id, slots, start_ms = args.serve
        serve(Path(home), int(port), redis_url, node_id, int(slots), float(start_ms))
        return

    work = Path(tempfile.mkdtemp(prefix="aenv-bench-cluster-rate-"))
    ports = {"b1": free_port(), "b2": free_port()}
    limit = args.slots / (args.start_ms / 1000)
    result: dict[str, Any] = {
        "benchmark": "cluster_create_rate", "creates": args.creates,
        "concurrency": args.concurrency,
        "node_model": f"real aenv Server per node, no VM: a start holds one of "
                      f"{args.slots} boot slots for {args.start_ms:g} ms",
        "node_limit_per_s": round(limit, 1), "load_before": os.getloadavg()}
    procs = []
    rates: dict[str, list[float]] = {"direct_one_node": [], "gateway_two_nodes": []}
    lat: dict[str, list[float]] = {"direct_one_node": [], "gateway_two_nodes": []}
    try:
        redis_proc, redis_url = start_redis(work)
        procs.append(redis_proc)
        for node_id, port in ports.items():
            procs.append(spawn_child(
                [sys.executable, __file__, "--serve", str(work / node_id), str(port), redis_url,
                 node_id, str(args.slots), str(args.start_ms)],
                f"http://127.0.0.1:{port}/health", log_path=work / f"{node_id}.log"))
        gw_proc, gw_url = start_gateway(work / "gateway", redis_url, KEY, SECRET)
        procs.append(gw_proc)
        node1 = f"http://127.0.0.1:{ports['b1']}"
        key1 = (work / "b1/secrets/api-key").read_text().strip()
        nodes_ready = httpx.get(gw_url + "/nodes", headers={"X-API-KEY": KEY}).json()
        assert [n["status"] for n in nodes_ready] == ["ready", "ready"], nodes_ready

        def phase(name: str, url: str, key: str) -> None:
            rate, ids, ms = asyncio.run(create_many(url, key, args.creates, args.concurrency))
            rates[name].append(round(rate, 1))
            lat[name].extend(ms)
            print(f"{name}: {rate:.1f} creates/s", file=sys.stderr)
            asyncio.run(kill_all(url, key, ids))

        for _ in range(args.rounds):
            phase("direct_one_node", node1, key1)
            phase("gateway_two_nodes", gw_url, KEY)
        httpx.post(f"http://127.0.0.1:{ports['b2']}/node/drain",
                   headers={"X-Aenv-Cluster-Secret": SECRET}).raise_for_status()
        rates["gateway_one_node"], lat["gateway_one_node"] = [], []
        phase("gateway_one_node", gw_url, KEY)
    finally:
        wind_down(result, procs, work, grace=10)
    for name, values in rates.items():
        result[name] = {"creates_per_s": values, "median_per_s": statistics.median(values),
                        "create_ms": summary(lat[name])}
    result["two_nodes_over_one_direct"] = round(
        result["gateway_two_nodes"]["median_per_s"]
        / result["direct_one_node"]["median_per_s"], 2)
    finish(result)


if __name__ == "__main__":
    main()
