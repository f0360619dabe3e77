"""Throughput and latency of ``GET /v2/sandboxes`` with 200 sandboxes in the store.

Run: ``.venv/bin/python benchmarks/api_list.py [--records 200] [--concurrency 1,8]
[--duration 5]``. Needs two CPUs; no root, no VMs.

Method: the script re-runs itself as a child (``--serve``) that pins itself to one CPU
(``os.sched_setaffinity``), builds the real ``aenv.server.Server`` over a temporary home
with a stand-in ``Machines`` that owns no VMs (``start`` refuses; ``reattach`` keeps every
stored sandbox, so recovery leaves them running), inserts ``--records`` sandbox records
straight into its SQLite store, and serves it with uvicorn as ``aenv server`` does (one
worker, uvloop/httptools when installed, no access log). The parent pins itself to another
CPU and drives the server over N keep-alive connections for each N in ``--concurrency``
(1: latency without queueing; 8: throughput, where latency is mostly waiting behind the
other 7), each connection sending requests back to back for ``--duration`` seconds after
a ``--warmup``. The generator is a
minimal HTTP/1.1 GET client on asyncio streams (uvloop when installed), because an httpx
client saturates its core near 1,500 requests/s, below what the server does for
``/health``; one httpx request per scenario checks the status and the number of items as
the SDK would see them. Per scenario: requests/s, client-side latency percentiles (ms), the
items returned, ``server_cpu_share`` (the server's CPU time over wall time: near 1.0 when it
is the limit) and ``client_cpu_share`` (the same for the generator).

Scenarios: ``/health`` (the stack's fixed cost, no auth, no store), the default page
(100 of 200), the full list (``?limit=<records>``), ``?limit=10``, and a metadata filter
matching one sandbox in ten (``?metadata=team%3Dt3``, as the SDK encodes it). The machine
has 2 cores shared with other work: compare runs, not single numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, free_port, spawn_child, stop, summary


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the server side (child process) ------------------------------------------------------

class StoredOnlyMachines:
    """Machines for sandboxes that exist only as store records: nothing to boot or stop."""

    can_pause = False

    async def prepare(self, keep_slots: set[int], keep_vms: set[str]) -> None:
        pass

    async def close(self) -> None:
        pass

    async def start(self, rec: Any, template: Any) -> Any:
        raise RuntimeError("this benchmark server starts no sandboxes")

    async def stop(self, rec: Any) -> None:
        pass

    async def reattach(self, rec: Any) -> bool:
        return True

    async def pause(self, rec: Any, memory: bool) -> str:
        raise RuntimeError("this benchmark server pauses nothing")

    async def resume(self, rec: Any) -> Any:
        raise RuntimeError("this benchmark server resumes nothing")

    async def commit(self, rec: Any, template_id: str) -> str:
        raise RuntimeError("this benchmark server builds nothing")

    def logs(self, rec: Any, start: int | None, limit: int) -> list[dict]:
        return []

    def in_use(self) -> set[int]:
        return set()


def serve(home: Path, port: int, cpu: int, records: int) -> None:
    import uvicorn

    from aenv.config import Settings
    from aenv.server import Server
    from aenv.store import SandboxRecord

    os.sched_setaffinity(0, {cpu})
    srv = Server(Settings(home=home), StoredOnlyMachines())  # type: ignore[arg-type]
    now = time.time()
    for i in range(records):
        srv.sandboxes.insert(SandboxRecord(
            id=f"bench{i:04d}{os.urandom(6).hex()}", template_id="base", alias="base",
            state="running", client_id="aenv", started_at=now - records + i,
            end_at=now + 24 * 3600, cpu_count=2, memory_mb=512, disk_size_mb=2048,
            metadata={"team": f"t{i % 10}", "run": "api-list-bench", "index": str(i)},
            envd_token=os.urandom(16).hex(), runtime="none"))
    uvicorn.run(srv.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_keep_alive=300, lifespan="on")


# -- the load generator (parent) ----------------------------------------------------------

class KeepAliveConnection:
    """A minimal HTTP/1.1 keep-alive GET client on asyncio streams: the load generator must
    cost much less than the server it measures, which httpx does not on one core."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.head = "".join(f"{k}: {v}\r\n" for k, v in
                            {"Host": f"{host}:{port}", **headers}.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\n{self.head}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"transfer-encoding":
                raise RuntimeError("chunked answers are not expected here")
        body = await self.reader.readexactly(length) if length else b""
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, server_pid: int, key: str, path: str, concurrency: int,
                duration: float, warmup: float) -> dict[str, Any]:
    """``concurrency`` connections, each sending GET ``path`` back to back: ``warmup``
    seconds unmeasured, then ``duration`` seconds measured."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-KEY": key}) as c:
        first = c.get(path)  # what the SDK would see: status and items
        first.raise_for_status()
        items = len(first.json()) if path.startswith("/v2/sandboxes") else None
    conns = [KeepAliveConnection("127.0.0.1", port, {"X-API-KEY": key})
             for _ in range(concurrency)]
    latencies: list[float] = []
    measuring = False
    stop_at = 0.0

    async def worker(conn: KeepAliveConnection) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status, body = await conn.get(path)
            t1 = time.perf_counter()
            if status >= 300:
                raise RuntimeError(f"GET {path} answered {status}: {body[:200]!r}")
            if measuring:
                latencies.append((t1 - t0) * 1000)

    try:
        stop_at = time.perf_counter() + warmup
        await asyncio.gather(*(worker(c) for c in conns))
        measuring = True
        cpu0, server0, t0 = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
        stop_at = t0 + duration
        await asyncio.gather(*(worker(c) for c in conns))
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        server_cpu = cpu_seconds(server_pid) - server0
    finally:
        for c in conns:
            await c.close()
    return {"path": path, "items": items, "requests_per_s": round(len(latencies) / wall, 1),
            "latency_ms": summary(latencies), "client_cpu_share": round(cpu / wall, 2),
            "server_cpu_share": round(server_cpu / wall, 2)}


def run(coro: Any) -> Any:
    """asyncio.run on uvloop when installed (a cheaper client loop), else the default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--concurrency", default="1,8",
                    help="comma-separated numbers of concurrent keep-alive connections")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds before each scenario")
    ap.add_argument("--serve", nargs=3, metavar=("HOME", "PORT", "CPU"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        home, port, cpu = args.serve
        serve(Path(home), int(port), int(cpu), args.records)
        return

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("api_list.py needs two CPUs: one for the server, one for the clients")
    server_cpu, client_cpu = cpus[0], cpus[1]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-list-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"benchmark": "api_list", "records": args.records,
                              "concurrency": concurrency, "duration_s": args.duration,
                              "server_cpu": server_cpu, "client_cpu": client_cpu,
                              "load_before": os.getloadavg()}
    proc = None
    try:
        log(f"serving {args.records} records on {url} (server on CPU {server_cpu})")
        proc = spawn_child([sys.executable, __file__, "--serve", str(home), str(port),
                            str(server_cpu), "--records", str(args.records)],
                           url + "/health", log_path=home / "server.log")
        os.sched_setaffinity(0, {client_cpu})
        key = (home / "secrets/api-key").read_text().strip()
        scenarios = {
            "health": "/health",
            "list_default_page": "/v2/sandboxes",
            "list_full": f"/v2/sandboxes?limit={args.records}",
            "list_limit_10": "/v2/sandboxes?limit=10",
            "list_metadata_filter": "/v2/sandboxes?metadata=team%3Dt3",
        }
        for name, path in scenarios.items():
            result[name] = {}
            for c in concurrency:
                log(f"{name}: GET {path} over {c} connection(s)")
                r = run(drive(port, proc.pid, key, path, c, args.duration, args.warmup))
                result[name][f"c{c}"] = r
                log(f"  {r['requests_per_s']} req/s, p50 {r['latency_ms']['p50']} ms")
    finally:
        if proc is not None:
            stop(proc)
        shutil.rmtree(home, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    emit(result)


if __name__ == "__main__":
    main()
