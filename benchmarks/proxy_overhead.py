"""What the aenv proxy adds to sandbox traffic: the same envd reached through the server's
listener and straight.

Run as root (commands run as the ``user`` account, as in a sandbox):
``.venv/bin/python benchmarks/proxy_overhead.py [--n 200] [--first 5]``.

Method: the script re-runs itself as a child (``--serve``) serving the real
``aenv.server.Server`` (API + proxy on one uvicorn listener, as ``aenv server`` runs it)
whose sandboxes are envd processes on the host (tests/control/process_machines.py), each on
its own loopback address at port 49983, so no VM adds noise. The addresses are probed free
first, away from the ones the test suite's process sandboxes use.

- ``first_request_ms`` / ``second_request_ms``: for ``--first`` fresh sandboxes (made and
  killed through the REST API), the first and the second proxied ``GET /health`` on one
  keep-alive client connection: the first pays the proxy's per-sandbox upstream client.
- ``sdk_run_true_ms``: the E2B Python SDK's ``commands.run("true")``, ``--n`` times each
  through the proxy (``E2B_SANDBOX_URL`` = the server, so the SDK routes by the
  ``E2b-Sandbox-Id``/``-Port`` headers) and straight to the sandbox's envd (the same
  sandbox connected again with ``E2B_SANDBOX_URL`` = envd's address), interleaved one by one
  so drifting load hits both alike, after ``--warmup`` unmeasured rounds.
- ``health_ms``: the same for ``GET /health`` with one keep-alive httpx client each; every
  timed answer must be a 204 (anything else stops the run).

``added_ms`` is proxied minus direct, at p50 and at p99 (null below 100 samples).
Clean-up, also on failure: the sandboxes are killed through the API, the server is stopped,
and any envd still serving on one of the probed addresses is reported (``leftover_envd``)
and killed. The host has 2 shared cores and client, proxy and envd all run on them: compare
runs, not single numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd import ENVD_PORT
from benchmarks._common import expect_status, free_port, spawn_child, summary
from benchmarks._servers import compare, finish, free_hosts, interleaved, log, serve_node, wind_down


def first_requests(api: httpx.Client, url: str, count: int) -> dict[str, Any]:
    first, second = [], []
    for _ in range(count):
        r = api.post("/v2/sandboxes", json={"templateID": "base"})
        r.raise_for_status()
        sid = r.json()["sandboxID"]
        try:
            route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
            with httpx.Client(base_url=url, timeout=30) as c:
                c.get("/health").raise_for_status()  # the server's own: opens the connection
                for out in (first, second):
                    t0 = time.perf_counter()
                    h = c.get("/health", headers=route)
                    out.append((time.perf_counter() - t0) * 1000)
                    if h.status_code != 204:
                        raise RuntimeError(f"proxied /health answered {h.status_code}")
        finally:
            api.delete(f"/sandboxes/{sid}")
    return {"first_request_ms": summary(first), "second_request_ms": summary(second)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="measured requests per path")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--first", type=int, default=5,
                    help="fresh sandboxes whose first proxied request is timed")
    ap.add_argument("--serve", nargs=3, metavar=("HOME", "PORT", "HOST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        from aenv.config import Settings

        home, port, host = args.serve
        serve_node(Settings(home=Path(home), listen_port=int(port)), int(host))
        return
    if os.geteuid() != 0:
        sys.exit("proxy_overhead.py needs root (commands run as the `user` account)")

    from e2b import Sandbox  # test dependency

    first_host = free_hosts(args.first + 1)
    hosts = range(first_host, first_host + args.first + 1)
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-proxy-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"benchmark": "proxy_overhead", "n": args.n,
                              "load_before": os.getloadavg()}
    proc = None
    try:
        log(f"server on {url}, sandboxes on 127.0.0.{first_host}..{hosts[-1]}:{ENVD_PORT}")
        proc = spawn_child([sys.executable, __file__, "--serve", str(home), str(port),
                            str(first_host)], url + "/health", log_path=home / "server.log")
        key = (home / "secrets/api-key").read_text().strip()
        with httpx.Client(base_url=url, headers={"X-API-KEY": key}, timeout=60) as api:
            result.update(first_requests(api, url, args.first))
            log(f"first proxied request p50 {result['first_request_ms']['p50']} ms, "
                f"second {result['second_request_ms']['p50']} ms")

            os.environ.update({"E2B_API_KEY": key, "E2B_API_URL": url, "E2B_DOMAIN": "localhost",
                               "E2B_SANDBOX_URL": url})
            via_proxy = Sandbox.create("base")
            envd_url = f"http://127.0.0.{hosts[-1]}:{ENVD_PORT}"  # the next address handed out
            os.environ["E2B_SANDBOX_URL"] = envd_url
            direct = Sandbox.connect(via_proxy.sandbox_id)
            try:
                # Both reach the same envd: a process started through one is listed by the
                # other.
                sleeper = via_proxy.commands.run("sleep 60", background=True)
                if sleeper.pid not in {p.pid for p in direct.commands.list()}:
                    raise RuntimeError(f"{envd_url} is not the envd behind the proxy")
                direct.commands.kill(sleeper.pid)
                log(f"commands.run('true') x{args.n}, proxied and direct")
                result["sdk_run_true_ms"] = compare(*interleaved(
                    lambda: via_proxy.commands.run("true"),
                    lambda: direct.commands.run("true"), n=args.n, warmup=args.warmup))
                log(f"GET /health x{args.n}, proxied and direct")
                with httpx.Client(base_url=url, timeout=30, headers={
                        "E2b-Sandbox-Id": via_proxy.sandbox_id,
                        "E2b-Sandbox-Port": str(ENVD_PORT)}) as pc, \
                        httpx.Client(base_url=envd_url, timeout=30) as dc:
                    # Every timed answer must be envd's 204: an error answer (a 502 from
                    # the proxy, a 401) is fast and would flatter the figures.
                    result["health_ms"] = compare(*interleaved(
                        lambda: expect_status(pc.get("/health"), 204),
                        lambda: expect_status(dc.get("/health"), 204), n=args.n,
                        warmup=args.warmup))
            finally:
                via_proxy.kill()
    finally:
        wind_down(result, [proc] if proc is not None else [], home, hosts)
    finish(result)


if __name__ == "__main__":
    main()
