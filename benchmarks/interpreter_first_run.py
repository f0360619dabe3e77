"""Create from ``code-interpreter-v1`` to the first ``run_code`` answered, against a create
from ``base`` to its first command, in one run (issue 19's goal: at most 1.5x).

Run as root: ``.venv/bin/python benchmarks/interpreter_first_run.py [--n 8] [--warmup 1]``.

Method: starts ``aenv server`` in a child process with its own home, name prefix and
address ranges (sharing the host's kernel, image and staged-library cache), builds
``code-interpreter-v1`` on it with ``aenv template build code-interpreter-v1`` (the build's
wall time is reported), then alternates, ``--warmup`` + ``--n`` times:

- e2b-code-interpreter's ``Sandbox.create()`` (its default template), then
  ``run_code("1+1")`` twice: ``ci_create`` is the create alone, ``ci_first_run`` the first
  ``run_code`` alone, ``ci_create_to_first_run`` both (the issue's figure), ``ci_second_run``
  the next one (warm);
- the E2B SDK's ``Sandbox.create("base")`` then ``commands.run("true")``:
  ``base_create_to_first_command``.

With ``--probe`` each code-interpreter sandbox first gets ``GET /health`` on port 49999
through the proxy (``ci_first_health``) before its first ``run_code``, to tell the path's
cost from the kernel's; the creates-to-first-run figures then include that request.

Every sandbox is killed after its sample; the server is stopped and its host objects checked
(``leftovers``). Output: one JSON object, milliseconds; ``ratio_p50`` is
``ci_create_to_first_run`` p50 over ``base_create_to_first_command`` p50 and ``goal_met``
says whether it is at most 1.5. Guests run under TCG on a shared 2-core host: compare runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from benchmarks._common import ROOT, emit, summary
from benchmarks._server import VMServer, leftovers, log

GOAL_RATIO = 1.5


def build_template(srv: VMServer, key: str) -> float:
    env = {**os.environ, "AENV_URL": srv.url, "AENV_API_KEY": key}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "aenv.cli.main", "template", "build",
                          "code-interpreter-v1"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"template build failed:\n{out.stdout}\n{out.stderr[-4000:]}")
    return time.monotonic() - started


def ms_since(t: float) -> float:
    return (time.monotonic() - t) * 1000


def one_round(srv: VMServer, key: str, probe: bool) -> dict[str, float]:
    from e2b import Sandbox as BaseSandbox
    from e2b_code_interpreter import Sandbox

    row: dict[str, float] = {}
    t0 = time.monotonic()
    sbx = Sandbox.create()
    try:
        row["ci_create"] = ms_since(t0)
        if probe:
            t = time.monotonic()
            r = httpx.get(f"{srv.url}/health", timeout=60, headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"})
            if r.status_code != 200:
                raise RuntimeError(f"GET :49999/health answered {r.status_code}: {r.text}")
            row["ci_first_health"] = ms_since(t)
        t = time.monotonic()
        ex = sbx.run_code("1+1")
        if ex.text != "2":
            raise RuntimeError(f"run_code('1+1') gave {ex.text!r} ({ex.error})")
        row["ci_first_run"] = ms_since(t)
        row["ci_create_to_first_run"] = ms_since(t0)
        t = time.monotonic()
        if sbx.run_code("1+1").text != "2":
            raise RuntimeError("the second run_code('1+1') gave another answer")
        row["ci_second_run"] = ms_since(t)
    finally:
        sbx.kill()
    t0 = time.monotonic()
    b = BaseSandbox.create("base")
    try:
        if b.commands.run("true").exit_code != 0:
            raise RuntimeError("commands.run('true') failed in base")
        row["base_create_to_first_command"] = ms_since(t0)
    finally:
        b.kill()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--net", type=int, default=118, help="10.<net>.0.0/24 and .1.0/24")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--keep-home", action="store_true")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="aenv-bench-ci-"))
    srv = VMServer(home, args.net, Settings.from_env().artifacts)
    rows: list[dict[str, float]] = []
    result: dict[str, Any] = {"benchmark": "interpreter_first_run", "n": args.n,
                              "warmup": args.warmup, "probe": args.probe}
    try:
        log(f"starting the server (home {home})")
        srv.start()
        key = (srv.settings.secrets_dir / "api-key").read_text().strip()
        os.environ.update({"E2B_API_KEY": key, "E2B_API_URL": srv.url,
                           "E2B_SANDBOX_URL": srv.url})
        os.environ.pop("E2B_DOMAIN", None)
        log("building code-interpreter-v1")
        result["template_build_s"] = round(build_template(srv, key), 1)
        log(f"built in {result['template_build_s']} s")
        for i in range(args.warmup + args.n):
            row = one_round(srv, key, args.probe)
            log(f"round {i}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))
            if i >= args.warmup:
                rows.append(row)
        keys = dict.fromkeys(k for r in rows for k in r)
        result.update({k: summary([r[k] for r in rows if k in r]) for k in keys})
        ci, base = result["ci_create_to_first_run"]["p50"], \
            result["base_create_to_first_command"]["p50"]
        result["ratio_p50"] = round(ci / base, 2)
        result["goal_ratio"] = GOAL_RATIO
        result["goal_met"] = ci / base <= GOAL_RATIO
    finally:
        try:
            srv.kill_all()
        except Exception as exc:  # the server may be gone; leftovers says what remains
            log(f"kill_all: {exc}")
        srv.stop()
        result["leftovers"] = leftovers(srv.settings)
        if args.keep_home:
            log(f"home kept: {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    emit(result)


if __name__ == "__main__":
    main()
