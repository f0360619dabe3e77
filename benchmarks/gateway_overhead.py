"""What ``aenv gateway`` adds: the same node and sandbox reached through a gateway and
straight (issue 18's "gateway overhead", goals: <= 2 ms at p50 on REST and
``commands.run``, <= 1 ms on envd ``/health``).

Run as root (commands run as the ``user`` account, as in a sandbox):
``.venv/bin/python benchmarks/gateway_overhead.py [--n 200] [--creates 20]``.

Method: a real ``redis-server`` on a free loopback port (persistence off); one node, the
real ``aenv.server.Server`` in a child process joined to the cluster, whose sandboxes are
envd processes on the host (``benchmarks/_servers.py``) so no VM adds noise; and two
gateways in children: ``aenv gateway`` as it ships, and the same gateway with its data
plane's hop to the node made by httpx, as before the relay (``aenv.proxy.relay``;
``ProxyRouter.relay_to_nodes`` off), the "before" of that change in the same run. Every
set of figures is measured interleaved one by one (drifting load hits all alike), after
``--warmup`` unmeasured rounds:

- ``health_ms``: envd ``GET /health`` routed by ``E2b-Sandbox-Id``/``-Port`` headers,
  through the gateway (gateway -> node -> envd) vs through the node (node -> envd);
- ``sdk_run_true_ms``: the E2B SDK's ``commands.run("true")``, the sandbox connected with
  ``E2B_SANDBOX_URL`` = the gateway and = the node;
- ``rest_create_kill_ms``: ``POST /v2/sandboxes`` then ``DELETE``, ``--creates`` times
  each way (a create here is an envd process start, ~0.2 s);
- ``*_httpx_hop``: ``health_ms`` and ``sdk_run_true_ms`` through the httpx gateway, in the
  same rounds as the two above.

``added_ms`` is through-the-gateway minus direct at p50 and p99. Clean-up, also on
failure: sandboxes killed, gateways, node and Redis stopped, any envd left on the probed
addresses reported (``leftover_envd``) and killed. 2 shared cores: compare runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd import ENVD_PORT
from benchmarks._common import expect_status, free_port, spawn_child
from benchmarks._servers import (
    compare,
    finish,
    free_hosts,
    interleaved,
    log,
    serve_node,
    start_gateway,
    start_redis,
    wind_down,
)

SECRET = "bench-cluster-secret-" + "0" * 24
GATEWAY_KEY = "e2b_" + "7" * 40


def serve_httpx_gateway(redis_url: str, port: int) -> None:
    """A gateway whose hop to the node is httpx's (child process)."""
    import uvicorn

    from aenv.cluster.gateway import Gateway
    from aenv.cluster.registry import Registry

    gw = Gateway(Registry.from_url(redis_url), api_key=GATEWAY_KEY, cluster_secret=SECRET)
    gw.proxy.relay_to_nodes = False
    uvicorn.run(gw.app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                timeout_keep_alive=300, lifespan="on")


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
    ap.add_argument("--serve-httpx-gateway", nargs=2, metavar=("REDIS", "PORT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        from aenv.config import Settings

        home, port, host, redis_url = args.serve
        serve_node(Settings(home=Path(home), listen_port=int(port), cluster=redis_url,
                            node_id="bench1", cluster_secret=SECRET,
                            advertise_url=f"http://127.0.0.1:{port}"), int(host))
        return
    if args.serve_httpx_gateway:
        redis_url, port = args.serve_httpx_gateway
        serve_httpx_gateway(redis_url, int(port))
        return
    if os.geteuid() != 0:
        sys.exit("gateway_overhead.py needs root (commands run as the `user` account)")

    from e2b import Sandbox  # test dependency

    warm_creates = min(args.warmup, 3)
    count = 2 * (args.creates + warm_creates) + 2
    first_host = free_hosts(count)
    hosts = range(first_host, first_host + count)
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-gateway-"))
    node_port = free_port()
    node_url = f"http://127.0.0.1:{node_port}"
    result: dict[str, Any] = {"benchmark": "gateway_overhead", "n": args.n,
                              "creates": args.creates, "load_before": os.getloadavg()}
    procs = []
    try:
        redis_proc, redis_url = start_redis(work)
        procs.append(redis_proc)
        procs.append(spawn_child(
            [sys.executable, __file__, "--serve", str(work / "node"), str(node_port),
             str(first_host), redis_url], node_url + "/health", log_path=work / "node.log"))
        gw_proc, gw_url = start_gateway(work / "gateway", redis_url, GATEWAY_KEY, SECRET)
        procs.append(gw_proc)
        old_proc, old_url = start_gateway(
            work / "gateway-httpx", redis_url, GATEWAY_KEY, SECRET,
            [sys.executable, __file__, "--serve-httpx-gateway", redis_url])
        procs.append(old_proc)
        node_key = (work / "node/secrets/api-key").read_text().strip()
        log(f"redis {redis_url}, node {node_url}, gateway {gw_url}, httpx gateway {old_url}")

        with httpx.Client(base_url=gw_url, headers={"X-API-KEY": GATEWAY_KEY},
                          timeout=60) as via, \
                httpx.Client(base_url=node_url, headers={"X-API-KEY": node_key},
                             timeout=60) as direct:
            log(f"create+kill x{args.creates}, through the gateway and direct")
            result["rest_create_kill_ms"] = compare(*interleaved(
                lambda: create_kill(via), lambda: create_kill(direct), n=args.creates,
                warmup=warm_creates))

        def connect(url: str, key: str, sandbox_id: str) -> Any:
            os.environ.update({"E2B_API_KEY": key, "E2B_API_URL": url,
                               "E2B_SANDBOX_URL": url, "E2B_DOMAIN": "localhost"})
            return Sandbox.connect(sandbox_id) if sandbox_id else Sandbox.create("base")

        through = connect(gw_url, GATEWAY_KEY, "")
        try:
            straight = connect(node_url, node_key, through.sandbox_id)
            old = connect(old_url, GATEWAY_KEY, through.sandbox_id)
            log(f"commands.run('true') x{args.n}: gateway, direct, httpx gateway")
            new_ms, direct_ms, old_ms = interleaved(
                lambda: through.commands.run("true"), lambda: straight.commands.run("true"),
                lambda: old.commands.run("true"), n=args.n, warmup=args.warmup)
            result["sdk_run_true_ms"] = compare(new_ms, direct_ms)
            result["sdk_run_true_ms_httpx_hop"] = compare(old_ms, direct_ms)
            route = {"E2b-Sandbox-Id": through.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
            log(f"envd GET /health x{args.n}: gateway, direct, httpx gateway")
            with httpx.Client(base_url=gw_url, headers=route, timeout=30) as gc, \
                    httpx.Client(base_url=node_url, headers=route, timeout=30) as nc, \
                    httpx.Client(base_url=old_url, headers=route, timeout=30) as oc:
                # Every timed answer must be envd's 204: an error answer is fast and would
                # flatter the figures.
                new_ms, direct_ms, old_ms = interleaved(
                    lambda: expect_status(gc.get("/health"), 204),
                    lambda: expect_status(nc.get("/health"), 204),
                    lambda: expect_status(oc.get("/health"), 204), n=args.n,
                    warmup=args.warmup)
            result["health_ms"] = compare(new_ms, direct_ms)
            result["health_ms_httpx_hop"] = compare(old_ms, direct_ms)
        finally:
            through.kill()
    finally:
        wind_down(result, procs, work, hosts)
    finish(result)

if __name__ == "__main__":
    main()
