"""``commands.run("true")`` round trip through the E2B SDK against envd on the host, with the
floors and phases that explain it.

Run: ``.venv/bin/python benchmarks/envd_commands.py [--n 200]`` (as root: commands run as
the ``user`` account, as in a sandbox). Prints one JSON object (milliseconds):

- ``sdk_run_true_ms``: the headline, sync SDK ``commands.run("true")``, default user.
- ``floor_subprocess_true_ms``: ``subprocess.run(["true"])`` in this process.
- phases, each measured on its own:
  ``child_wrapped_login_bash_ms``: exactly the child envd starts (same spawn code, setpriv,
  sh wrapper, ``bash -l -c true``) run from this process, start to reaped;
  ``child_wrapped_plain_bash_ms``: the same with ``bash -c`` (no profile sourcing);
  ``sdk_unary_list_ms``: SDK ``commands.list()``, the per-request cost of SDK + HTTP + envd;
  ``raw_start_true_ms``: the same Start as the SDK sends, by plain httpx (no SDK);
  ``envd_spawn_ms`` / ``envd_process_lifetime_ms``: from envd's own log, spawn call and
  spawn-to-end of each process the SDK started (a second envd with info logging).
The machine is shared and has 2 cores: expect noise, compare p50s of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.envd.process import launch
from aenv.envd.users import User
from benchmarks._common import Envd, emit, summary

WARMUP = 20


def timed(fn: Callable[[], object], n: int) -> list[float]:
    for _ in range(WARMUP):
        fn()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def run_child(bash_args: list[str]) -> None:
    """Start and reap the child envd would start for ``bash <args> true``, as ``user``."""
    user = User.lookup("user")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": user.home, "USER": user.name,
           "LOGNAME": user.name, "E2B_SANDBOX": "true"}
    spec = launch.LaunchSpec("/bin/bash", [*bash_args, "true"], env, user.home, user, False,
                             None)
    spawned = launch.spawn(spec)
    fds = [fd for fd in (spawned.stdout, spawned.stderr) if fd is not None]
    for fd in fds:
        os.set_blocking(fd, True)
        while os.read(fd, 65536):
            pass
        os.close(fd)
    spawned.reaped(os.waitpid(spawned.pid, 0)[1])


def raw_start(client: httpx.Client, url: str) -> None:
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]},
                       "stdin": False}).encode()
    r = client.post(url + "/process.Process/Start",
                    content=b"\x00" + len(body).to_bytes(4, "big") + body,
                    headers={"content-type": "application/connect+json",
                             "connect-protocol-version": "1", "keepalive-ping-interval": "50",
                             "connect-timeout-ms": "60000"})
    assert r.status_code == 200 and b'"end"' in r.content, r.content


def sdk_sandbox(url: str):
    os.environ["E2B_SANDBOX_URL"] = url
    from e2b import Sandbox  # test dependency; debug mode talks to envd directly

    return Sandbox.create(debug=True, api_key="e2b_" + "0" * 40)


def envd_log_phases(n: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "envd.log"
        with Envd("--log-level", "info", access_token=False, log_path=log) as envd:
            sandbox = sdk_sandbox(envd.url)
            timed(lambda: sandbox.commands.run("true"), n)
        text = log.read_text()
    spawn = [float(v) for v in re.findall(r"process started .*?spawn_ms=([\d.]+)", text)]
    life = [float(v) for v in re.findall(r"process ended .*?duration_ms=([\d.]+)", text)]
    return {"envd_spawn_ms": summary(spawn[WARMUP:]),
            "envd_process_lifetime_ms": summary(life[WARMUP:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("envd_commands.py needs root (commands run as the `user` account)")

    result: dict[str, object] = {"benchmark": "envd_commands", "n": args.n}
    with Envd(access_token=False) as envd:
        sandbox = sdk_sandbox(envd.url)
        result["sdk_run_true_ms"] = summary(timed(lambda: sandbox.commands.run("true"), args.n))
        result["floor_subprocess_true_ms"] = summary(
            timed(lambda: subprocess.run(["true"], check=True), args.n))
        with httpx.Client(timeout=30) as client:
            raw = summary(timed(lambda: raw_start(client, envd.url), args.n))
        result["phases"] = {
            "child_wrapped_login_bash_ms": summary(timed(lambda: run_child(["-l", "-c"]),
                                                         args.n)),
            "child_wrapped_plain_bash_ms": summary(timed(lambda: run_child(["-c"]), args.n)),
            "sdk_unary_list_ms": summary(timed(sandbox.commands.list, args.n)),
            "raw_start_true_ms": raw,
        }
    result["phases"].update(envd_log_phases(args.n))  # type: ignore[union-attr]
    emit(result)


if __name__ == "__main__":
    main()
