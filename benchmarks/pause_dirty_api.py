"""Pause after dirtying guest memory, through the API, then resume at once: the pause's
memory written in the background with the resume continuing the frozen VMM in place, in
the background with the resume waiting for the write, and within the request, side by side
(issue 21, item 5).

Run as root: ``.venv/bin/python benchmarks/pause_dirty_api.py [--reps 8] [--dirty-mib 200]
[--net 184] [--sides in_place,background,in_request]``

Method: one ``aenv server`` of this tree per side (``benchmarks/_server.py``; nets ``--net``,
``--net`` + 1, ...): ``in_place`` (``AENV_PAUSE_MEMORY_IN_BACKGROUND=1``,
``AENV_RESUME_IN_PLACE=1``, the defaults: the pause answers once device state and disk are
saved, memory is written after, and a resume during the write continues the frozen VMM),
``background`` (the same with ``AENV_RESUME_IN_PLACE=0``: the resume waits for the write,
then restores) and ``in_request`` (``AENV_PAUSE_MEMORY_IN_BACKGROUND=0``: memory written
within the pause). They take turns, one rep each, so all see the same host load. Per rep, on
each: a sandbox from ``base`` (a restore, as every create); a guest process fills
``--dirty-mib`` MiB with a non-zero byte; ``POST /sandboxes/{id}/pause`` timed by the client
(``pause_ms``); at once ``POST /sandboxes/{id}/connect`` (the resume the SDK's ``connect``
makes) timed (``resume_right_after_ms``); the guest is asked whether its dirtying process's
file is still there (not timed: a resumed guest must be the paused one); then the sandbox
is killed. Output: one JSON object, every summary with its n (p99 null below 100 samples);
``pause_phases_ms`` and ``resume_phases_ms``: the phases the answers' ``Server-Timing``
names.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.timing import parse_server_timing
from benchmarks._common import emit, expect_status, phase_summaries, summary
from benchmarks._server import VMServer, log

SIDES = {
    "in_place": {"AENV_PAUSE_MEMORY_IN_BACKGROUND": "1", "AENV_RESUME_IN_PLACE": "1"},
    "background": {"AENV_PAUSE_MEMORY_IN_BACKGROUND": "1", "AENV_RESUME_IN_PLACE": "0"},
    "in_request": {"AENV_PAUSE_MEMORY_IN_BACKGROUND": "0"},
}


def _still_there(srv: VMServer, sid: str, token: str | None) -> bool:
    from aenv.client.envd import EnvdClient

    async def go() -> bool:
        envd = EnvdClient.through_proxy(srv.url, sid, token)
        try:
            return (await envd.run("test -e /tmp/dirty-ready")).exit_code == 0
        finally:
            await envd.aclose()

    return asyncio.run(go())


def _dirty(srv: VMServer, sid: str, token: str | None, mib: int) -> None:
    from aenv.client.envd import EnvdClient

    async def go() -> None:
        envd = EnvdClient.through_proxy(srv.url, sid, token)
        try:
            await envd.start_background(
                f"python3 -c \"import time; x = bytearray(b'\\xa5') * ({mib} << 20); "
                f"open('/tmp/dirty-ready', 'w').close(); time.sleep(3600)\"")
            deadline = time.monotonic() + 300
            while (await envd.run("test -e /tmp/dirty-ready")).exit_code != 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("the guest did not finish dirtying memory")
                await asyncio.sleep(0.2)
        finally:
            await envd.aclose()

    asyncio.run(go())


def one(srv: VMServer, api: httpx.Client, mib: int) -> dict[str, Any]:
    r = expect_status(api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600}),
                      201)
    sid, token = r.json()["sandboxID"], r.json().get("envdAccessToken")
    _dirty(srv, sid, token, mib)
    t0 = time.perf_counter()
    paused = expect_status(api.post(f"/sandboxes/{sid}/pause"), 204)
    t1 = time.perf_counter()
    resumed = expect_status(api.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}),
                            200, 201)
    t2 = time.perf_counter()
    if not _still_there(srv, sid, token):
        raise AssertionError(f"{sid}: the resumed guest lost the state of its pause")
    expect_status(api.delete(f"/sandboxes/{sid}"), 204)
    return {"pause_ms": (t1 - t0) * 1000, "resume_right_after_ms": (t2 - t1) * 1000,
            # The pause's own phases (ms), when the server says (since 1d7d8fc).
            "pause_phases": parse_server_timing(paused.headers.get("server-timing", "")),
            "resume_phases": parse_server_timing(resumed.headers.get("server-timing", ""))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--dirty-mib", type=int, default=200)
    ap.add_argument("--net", type=int, default=184)
    ap.add_argument("--sides", default=",".join(SIDES),
                    help=f"comma-separated, of {', '.join(SIDES)}")
    args = ap.parse_args()
    names = [n for n in args.sides.split(",") if n]
    if not names or set(names) - set(SIDES):
        sys.exit(f"--sides: choose among {', '.join(SIDES)}")
    if os.geteuid() != 0:
        sys.exit("pause_dirty_api.py needs root (network namespaces and taps)")
    cache = Settings.from_env().artifacts
    sides = {
        name: VMServer(Path(tempfile.mkdtemp(prefix="aenv-bench-pausedirty-")),
                       args.net + i, cache, letters="p" + "cbi"[list(SIDES).index(name)],
                       env=SIDES[name])
        for i, name in enumerate(names)}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    t0 = time.monotonic()
    try:
        for srv in sides.values():
            srv.start()
        apis = {k: srv.api() for k, srv in sides.items()}
        for i in range(args.reps):
            shift = i % len(sides)
            order = list(sides)[shift:] + list(sides)[:shift]
            for k in order:
                row = one(sides[k], apis[k], args.dirty_mib)
                rows[k].append(row)
                log(f"{k} {i + 1}/{args.reps}: pause {row['pause_ms']:.0f} ms, resume right "
                    f"after {row['resume_right_after_ms']:.0f} ms")
        for c in apis.values():
            c.close()
    finally:
        for srv in sides.values():
            srv.shut_down()
    emit({"benchmark": "pause_dirty_api", "dirty_mib": args.dirty_mib,
          "wall_s": round(time.monotonic() - t0, 1),
          **{k: {**{m: summary([r[m] for r in rs])
                    for m in ("pause_ms", "resume_right_after_ms")},
                 "pause_phases_ms": phase_summaries([r["pause_phases"] for r in rs]),
                 "resume_phases_ms": phase_summaries([r["resume_phases"] for r in rs])}
             for k, rs in rows.items()},
          "goals": {"pause_after_dirtying_200mib_p50_ms": 200}})


if __name__ == "__main__":
    main()
