"""What ``aenv gateway`` adds: the same node and sandbox reached through a gateway and
straight (issue 18's "gateway overhead", goals: <= 2 ms at p50 on REST and
``commands.run``, <= 1 ms on envd ``/health``).

Run as root (commands run as the ``user`` account, as in a sandbox):
``.venv/bin/python benchmarks/gateway_overhead.py [--n 200] [--creates 20]``.

Method: a real ``redis-server`` on a free loopback port (persistence off); one node, the
real ``aenv.server.Server`` in a child process (``--serve``) joined to the cluster, whose
sandboxes are envd processes on the host (tests/control/process_machines.py, each on its
own loopback address) so no VM adds noise; and ``aenv gateway`` in another child. Every
pair of figures is measured interleaved one by one (drifting load hits both alike), after
``--warmup`` unmeasured rounds:

- ``health_ms``: envd ``GET /health`` routed by ``E2b-Sandbox-Id``/``-Port`` headers,
  through the gateway (gateway -> node -> envd) vs through the node (node -> envd);
- ``sdk_run_true_ms``: the E2B SDK's ``commands.run("true")``, the sandbox connected once
  with ``E2B_SANDBOX_URL`` = the gateway and once = the node;
- ``rest_create_kill_ms``: ``POST /v2/sandboxes`` then ``DELETE``, ``--creates`` times
  each way (a create here is an envd process start, ~0.2 s).

``added_ms`` is through-the-gateway minus direct at p50 and p99. Clean-up, also on
failure: sandboxes killed, gateway, node and Redis stopped, any envd left on the probed
addresses reported (``leftover_envd``) and killed. 2 shared cores: compare runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd import ENVD_PORT
from benchmarks._common import emit, free_port, spawn_child, stop
from benchmarks.proxy_overhead import compare, envd_pids, free_hosts, interleaved, log

SECRET = "bench-cluster-secret-" + "0" * 24
GATEWAY_KEY = "e2b_" + "7" * 40


def serve(home: Path, port: int, first_host: int, redis_url: str) -> None:
    """The node: aenv's Server over process sandboxes, in a cluster (child process)."""
    import uvicorn

    from aenv.config import Settings
    from aenv.server import Server
    from tests.control.process_machines import ProcessMachines

    machines = ProcessMachines()
    machines._next = first_host
    settings = Settings(home=home, listen_port=port, cluster=redis_url, node_id="bench1",
                        cluster_secret=SECRET, advertise_url=f"http://127.0.0.1:{port}")
    srv = Server(settings, machines)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(srv.app, host="127.0.0.1", port=port, log_level="warning",
                    access_log=False, timeout_keep_alive=300, lifespan="on")
    finally:
        machines.stop_all()


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    with open(workdir / "redis.log", "ab") as out:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", str(workdir)], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    import time

    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=0.5) as r:
                r.ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop(proc)
                raise
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def create_kill(api: httpx.Client) -> None:
    r = api.post("/v2/sandboxes", json={"templateID": "base"})
    r.raise_for_status()
    api.delete(f"/sandboxes/{r.json()['sandboxID']}").raise_for_status()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="measured /health and commands.run")
    ap.add_argument("--creates", type=int, default=20, help="measured create+kill each way")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--serve", nargs=4, metavar=("HOME", "PORT", "HOST", "REDIS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        home, port, host, redis_url = args.serve
        serve(Path(home), int(port), int(host), redis_url)
        return
    if os.geteuid() != 0:
        sys.exit("gateway_overhead.py needs root (commands run as the `user` account)")

    from e2b import Sandbox  # test dependency

    warm_creates = min(args.warmup, 3)
    count = 2 * (args.creates + warm_creates) + 2
    first_host = free_hosts(count)
    hosts = range(first_host, first_host + count)
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-gateway-"))
    node_port, gw_port = free_port(), free_port()
    node_url, gw_url = f"http://127.0.0.1:{node_port}", f"http://127.0.0.1:{gw_port}"
    result: dict[str, Any] = {"benchmark": "gateway_overhead", "n": args.n,
                              "creates": args.creates, "load_before": os.getloadavg()}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        redis_proc, redis_url = start_redis(work)
        procs.append(redis_proc)
        procs.append(spawn_child(
            [sys.executable, __file__, "--serve", str(work / "node"), str(node_port),
             str(first_host), redis_url], node_url + "/health", log_path=work / "node.log"))
        env = {**os.environ, "AENV_HOME": str(work / "gateway"), "AENV_API_KEY": GATEWAY_KEY,
               "AENV_CLUSTER_SECRET": SECRET}
        procs.append(spawn_child(
            [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(gw_port),
             "--cluster", redis_url, "--log-level", "warning"], gw_url + "/health",
            log_path=work / "gateway.log", env=env))
        node_key = (work / "node/secrets/api-key").read_text().strip()
        log(f"redis {redis_url}, node {node_url}, gateway {gw_url}")

        with httpx.Client(base_url=gw_url, headers={"X-API-KEY": GATEWAY_KEY},
                          timeout=60) as via, \
                httpx.Client(base_url=node_url, headers={"X-API-KEY": node_key},
                             timeout=60) as direct:
            log(f"create+kill x{args.creates}, through the gateway and direct")
            result["rest_create_kill_ms"] = compare(*interleaved(
                lambda: create_kill(via), lambda: create_kill(direct), args.creates,
                warm_creates))

        os.environ.update({"E2B_API_KEY": GATEWAY_KEY, "E2B_API_URL": gw_url,
                           "E2B_SANDBOX_URL": gw_url, "E2B_DOMAIN": "localhost"})
        through = Sandbox.create("base")
        try:
            os.environ.update({"E2B_API_KEY": node_key, "E2B_API_URL": node_url,
                               "E2B_SANDBOX_URL": node_url})
            straight = Sandbox.connect(through.sandbox_id)
            log(f"commands.run('true') x{args.n}, through the gateway and direct")
            result["sdk_run_true_ms"] = compare(*interleaved(
                lambda: through.commands.run("true"), lambda: straight.commands.run("true"),
                args.n, args.warmup))
            route = {"E2b-Sandbox-Id": through.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
            log(f"envd GET /health x{args.n}, through the gateway and direct")
            with httpx.Client(base_url=gw_url, headers=route, timeout=30) as gc, \
                    httpx.Client(base_url=node_url, headers=route, timeout=30) as nc:
                result["health_ms"] = compare(*interleaved(
                    lambda: gc.get("/health").raise_for_status(),
                    lambda: nc.get("/health").raise_for_status(), args.n, args.warmup))
        finally:
            through.kill()
    finally:
        for proc in reversed(procs):
            stop(proc, grace=15)
        left = envd_pids(hosts)
        result["leftover_envd"] = left
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    emit(result)


if __name__ == "__main__":
    main()
