"""``GET /v2/sandboxes`` through ``aenv gateway`` over 1,000 indexed sandboxes on 3 nodes
(issue 18's measure: p50 latency).

``.venv/bin/python benchmarks/cluster_list.py [--sandboxes 1000] [--nodes 3] [--n 200]``

Method (no VMs, no real nodes): a real ``redis-server`` on a free loopback port; in one
child process, 3 fake nodes: each a real ``NodeAgent`` (heartbeat, publish) that puts
its share of the sandboxes into the Redis index, and a small ASGI server answering list
requests from that same data, paged as ``aenv.api.listing`` pages (the fake nodes of
tests/cluster/test_gateway.py); and a real ``aenv gateway`` in another child. Measured,
interleaved one by one after ``--warmup`` rounds:

- ``first_page_ms``: ``GET /v2/sandboxes`` (the default limit, 100) through the gateway,
  which asks all 3 nodes and merges;
- ``first_page_direct_ms``: the same on one fake node directly (its own ~333);
- ``all_pages_ms``: every page through the gateway with ``limit=100`` and ``nextToken``
  until the end (1,000 sandboxes: 10 pages), the whole walk per sample;
- ``one_page_of_1000_ms``: ``limit=1000`` through the gateway (one page with everything).

So the figures are the gateway's fan-out, merge and paging plus a fake node's answer,
not a real node's store query (see benchmarks/api_list.py for that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import free_port, spawn_child, summary
from benchmarks._servers import finish, start_gateway, start_redis, wind_down

SECRET = "bench-cluster-secret-" + "1" * 24
KEY = "e2b_" + "6" * 40


def sandboxes_of(node: int, nodes: int, total: int) -> list[dict[str, Any]]:
    """Node ``node``'s share of ``total`` sandboxes, as a node lists them."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    out = []
    for i in range(node, total, nodes):
        started = t0 + timedelta(seconds=i)
        out.append({"sandboxID": f"sbx{i:05d}n{node}", "templateID": "base", "alias": "base",
                    "clientID": "bench", "startedAt": started.isoformat().replace("+00:00", "Z"),
                    "endAt": (started + timedelta(hours=1)).isoformat().replace("+00:00", "Z"),
                    "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 2048, "metadata": {},
                    "state": "running", "envdVersion": "0.2.0"})
    return out


async def serve_nodes(redis_url: str, ports: list[int], total: int) -> None:
    """The fake nodes (child process): agents publishing to Redis, servers answering."""
    import uvicorn

    from aenv.cluster.node_agent import NodeAgent
    from aenv.cluster.registry import IndexEntry, NodeRecord, Registry
    from tests.cluster.test_gateway import FakeNode

    servers, agents = [], []
    for i, port in enumerate(ports):
        node = FakeNode(f"n{i}", sandboxes=sandboxes_of(i, len(ports), total), port=port)
        node.seen = _Forgetful()  # it records every request otherwise
        entries = [IndexEntry(s["sandboxID"]) for s in node.sandboxes]
        agents.append(NodeAgent(Registry.from_url(redis_url),
                                NodeRecord(node.name, node.url, "bench"),
                                lambda e=entries: e))  # type: ignore[misc]
        servers.append(uvicorn.Server(uvicorn.Config(
            node, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
            access_log=False)))
    for a in agents:
        await a.start()
    await asyncio.gather(*(s.serve() for s in servers))


class _Forgetful(list[Any]):
    def append(self, item: Any) -> None:
        pass


def walk(client: httpx.Client) -> int:
    """Every page with limit=100; the number of sandboxes seen."""
    seen, token = 0, None
    while True:
        r = client.get("/v2/sandboxes", params={"limit": 100, **(
            {"nextToken": token} if token else {})})
        r.raise_for_status()
        seen += len(r.json())
        token = r.headers.get("x-next-token")
        if not token:
            return seen


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--n", type=int, default=200, help="samples of each single request")
    ap.add_argument("--walks", type=int, default=50, help="samples of the whole paged walk")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--serve", nargs=3, metavar=("REDIS", "PORTS", "TOTAL"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        redis_url, ports, total = args.serve
        asyncio.run(serve_nodes(redis_url, [int(p) for p in ports.split(",")], int(total)))
        return

    work = Path(tempfile.mkdtemp(prefix="aenv-bench-cluster-list-"))
    ports = [free_port() for _ in range(args.nodes)]
    result: dict[str, Any] = {
        "benchmark": "cluster_list", "sandboxes": args.sandboxes, "nodes": args.nodes,
        "method": "fake nodes (no VMs): real NodeAgents publish the index into a real Redis, "
                  "small ASGI servers answer the list requests from that data; a real "
                  "aenv gateway", "load_before": os.getloadavg()}
    procs = []
    try:
        redis_proc, redis_url = start_redis(work)
        procs.append(redis_proc)
        procs.append(spawn_child(
            [sys.executable, __file__, "--serve", redis_url, ",".join(map(str, ports)),
             str(args.sandboxes)], f"http://127.0.0.1:{ports[-1]}/v2/sandboxes",
            log_path=work / "nodes.log"))
        gw_proc, gw_url = start_gateway(work / "gateway", redis_url, KEY, SECRET)
        procs.append(gw_proc)
        import redis as redis_lib

        with redis_lib.Redis.from_url(redis_url) as r:
            deadline = time.monotonic() + 30
            while r.hlen("aenv:sandboxes") < args.sandboxes:
                assert time.monotonic() < deadline, "the index was not published"
                time.sleep(0.1)
            result["indexed"] = r.hlen("aenv:sandboxes")
        with httpx.Client(base_url=gw_url, headers={"X-API-KEY": KEY}, timeout=30) as gw, \
                httpx.Client(base_url=f"http://127.0.0.1:{ports[0]}", timeout=30) as node:
            assert walk(gw) == args.sandboxes, "the gateway's pages miss sandboxes"
            assert len(gw.get("/v2/sandboxes", params={"limit": 1000}).json()) == min(
                1000, args.sandboxes)
            series: dict[str, list[float]] = {k: [] for k in (
                "first_page_ms", "first_page_direct_ms", "one_page_of_1000_ms")}
            for i in range(args.warmup + args.n):
                a = timed(lambda: gw.get("/v2/sandboxes").raise_for_status())
                b = timed(lambda: node.get("/v2/sandboxes").raise_for_status())
                c = timed(lambda: gw.get("/v2/sandboxes",
                                         params={"limit": 1000}).raise_for_status())
                if i >= args.warmup:
                    series["first_page_ms"].append(a)
                    series["first_page_direct_ms"].append(b)
                    series["one_page_of_1000_ms"].append(c)
            walks = [timed(lambda: walk(gw)) for _ in range(args.walks)]
        for k, v in series.items():
            result[k] = summary(v)
        result["all_pages_ms"] = {**summary(walks), "pages": -(-args.sandboxes // 100)}
    finally:
        wind_down(result, procs, work, grace=10)
    finish(result)


if __name__ == "__main__":
    main()
