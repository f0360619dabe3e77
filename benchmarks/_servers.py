"""What the proxy and cluster benchmarks share: the child processes they measure (a node
over process sandboxes, Redis, a gateway), paired timing, and the clean-up at the end.

- ``serve_node``: the real ``aenv.server.Server`` in a child process, whose sandboxes are
  envd processes on the host (tests/control/process_machines.py), each on its own
  loopback address at port 49983 (``free_hosts`` finds a free run of them, away from the
  test suite's), so no VM adds noise;
- ``start_redis``: a real ``redis-server`` on a free loopback port, persistence off;
- ``start_gateway``: ``aenv gateway`` over it, as a child;
- ``interleaved`` / ``compare``: two ways of doing one thing, timed alternately (drifting
  load hits both alike), and what the first adds to the second at p50 and p99;
- ``wind_down``: children stopped, envd processes left on the probed addresses reported
  (``leftover_envd``) and killed, the work directory removed, the result printed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd import ENVD_PORT
from benchmarks._common import emit, free_port, spawn_child, stop, summary, tail

if TYPE_CHECKING:
    from aenv.config import Settings

FIRST_HOST = 200  # 127.0.0.200 and up: the test suite's process sandboxes start at .2


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- children -------------------------------------------------------------------------------

def serve_node(settings: Settings, first_host: int) -> None:
    """Serve ``aenv.server.Server`` over process sandboxes on ``settings.listen_port``, as
    ``aenv server`` runs it (API and proxy on one uvicorn listener); for a child process."""
    import uvicorn

    from aenv.server import Server
    from tests.control.process_machines import ProcessMachines

    machines = ProcessMachines()
    machines._next = first_host  # its next sandbox's address: 127.0.0.<first_host>
    srv = Server(settings, machines)
    # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into an exit so the
    # envd processes are stopped below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(srv.app, host="127.0.0.1", port=settings.listen_port,
                    log_level="warning", access_log=False, timeout_keep_alive=300,
                    lifespan="on")
    finally:
        machines.stop_all()


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A ``redis-server`` for the run; (its process, ``redis://`` URL of DB 0)."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    with open(workdir / "redis.log", "ab") as out:
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", str(workdir)], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
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


def start_gateway(workdir: Path, redis_url: str, api_key: str, secret: str,
                  argv: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``aenv gateway`` on a free port (or ``argv`` + the port, another way to serve
    one); (its process, URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AENV_HOME": str(workdir), "AENV_API_KEY": api_key,
           "AENV_CLUSTER_SECRET": secret}
    cmd = [*argv, str(port)] if argv else [
        sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(port),
        "--cluster", redis_url, "--log-level", "warning"]
    workdir.mkdir(parents=True, exist_ok=True)
    proc = spawn_child(cmd, url + "/health", log_path=workdir / "gateway.log", env=env)
    return proc, url


# -- process sandboxes ------------------------------------------------------------------------

def free_hosts(count: int) -> int:
    """The first N >= FIRST_HOST such that 127.0.0.N .. N+count-1 have port 49983 free."""
    for start in range(FIRST_HOST, 255 - count):
        ok = True
        for n in range(start, start + count):
            with socket.socket() as s:
                try:
                    s.bind((f"127.0.0.{n}", ENVD_PORT))
                except OSError:
                    ok = False
                    break
        if ok:
            return start
    raise RuntimeError("no free run of loopback addresses for the envd processes")


def envd_pids(hosts: range) -> list[int]:
    """Processes of ``python -m aenv.envd`` serving one of ``hosts`` (127.0.0.N)."""
    wanted = {f"127.0.0.{n}".encode() for n in hosts}
    pids = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{e.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"aenv.envd" in argv and any(a in wanted for a in argv):
            pids.append(int(e.name))
    return pids


# -- timing ---------------------------------------------------------------------------------

def interleaved(*fns: Callable[[], object], n: int, warmup: int) -> list[list[float]]:
    """Run ``fns`` in turn, ``warmup + n`` rounds; milliseconds of each after the warm-up,
    in the order given."""
    outs: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + n):
        for fn, out in zip(fns, outs, strict=True):
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1000
            if i >= warmup:
                out.append(ms)
    return outs


def compare(proxied: list[float], direct: list[float]) -> dict[str, Any]:
    """Both summaries and what the first adds at p50 and, with enough samples, p99."""
    p, d = summary(proxied), summary(direct)
    tp, td = tail(p), tail(d)
    return {"proxied": p, "direct": d,
            "added_ms": {"p50": round(p["p50"] - d["p50"], 2),
                         "p99": None if tp is None or td is None else round(tp - td, 2)}}


# -- the end --------------------------------------------------------------------------------

def wind_down(result: dict[str, Any], procs: list[subprocess.Popen[bytes]], work: Path,
              hosts: range | None = None, grace: float = 15) -> None:
    """Stop ``procs`` (last started first), kill envd processes left on ``hosts``, remove
    ``work``; for a ``finally``. ``finish`` then prints the result."""
    for proc in reversed(procs):
        stop(proc, grace=grace)
    if hosts is not None:
        left = envd_pids(hosts)
        result["leftover_envd"] = left
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(work, ignore_errors=True)


def finish(result: dict[str, Any]) -> None:
    result["load_after"] = os.getloadavg()
    emit(result)
