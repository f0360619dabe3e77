"""Snapshot operations as a client sees them, through the REST API of a real ``aenv server``.

Run as root: ``.venv/bin/python benchmarks/sandbox_snapshots.py [--n 10] [--forks 5]``

Method: one server (its own home, prefix and address ranges; ``benchmarks/_server.py``)
with base kept as a snapshot, and a second one started with ``--no-snapshot-base`` for the
cold-boot comparison. Client-side wall times (httpx, one keep-alive connection), each
operation ``--n`` times:

- ``create_restore`` vs ``create_cold``: ``POST /v2/sandboxes`` from base, to the 201 (the
  server answers only after envd ran ``/init``);
- ``pause`` (``POST .../pause`` → 204) and ``resume`` (``POST /v2/.../connect`` → 201) of a
  sandbox that holds a file and runs a loop writing the time once a second;
  ``resume_busy``: of one whose loop ticks every 0.1 s (under TCG the loop's execs in the
  fresh VMM compete with envd's first answer for the one vCPU);
- ``snapshot``: ``POST .../snapshots`` of a running sandbox (→ 201);
- ``fork16``: ``POST .../fork {"count": 16}`` of a fresh sandbox (restored from base) that
  holds a file and runs a process (a loop that writes the time once a second, mostly
  asleep), until the answer, which comes once every child has been restored and its envd
  initialised (``--forks`` rounds; the children are killed between rounds);
  ``fork16_quiet``: the same from a sandbox that holds the file only; ``fork16_busy``: from
  one whose loop ticks every 0.1 s. Under TCG each tick execs two programs in every child,
  about half a core per child here, so with 17 guests on 2 cores this one measures CPU
  contention more than the fork.
- ``*_phases``: the server's own breakdown from the ``Server-Timing`` header (p50 over the
  rounds): a resume's ``slot``/``restore``/``envd_init``; a fork's ``capture``,
  ``children`` (restores and inits, wall) and the median and slowest child per phase.

The runtime-level figures (freeze time, 256 MiB vs 2 GiB, memory per child) are
``benchmarks/vm_snapshot.py``. Output: one JSON object, milliseconds. The host has 2 shared
cores and guests run under TCG: noisy; compare p50s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.timing import parse_server_timing
from benchmarks._common import emit, expect_status, phase_summaries, summary
from benchmarks._server import VMServer, log

STATE = "echo state > /home/user/state.txt"


def ticking(period: str) -> str:
    """A file plus a background loop writing the time every ``period`` seconds."""
    return (f"nohup bash -c 'while true; do date +%s%N > /tmp/tick; sleep {period}; done' "
            f">/dev/null 2>&1 & {STATE}")


# Fork sources. Under TCG each child is a fresh QEMU with an empty translation cache, and
# every program its guest execs costs it that code's translation again.
FORK_SOURCES = {"fork16": ticking("1"), "fork16_quiet": STATE, "fork16_busy": ticking("0.1")}


def timed(fn: Callable[[], httpx.Response], status: int,
          phases: list[dict[str, float]] | None = None) -> float:
    """Client wall time of ``fn()`` (ms); its ``Server-Timing`` goes to ``phases``."""
    t0 = time.perf_counter()
    r = fn()
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != status:
        raise RuntimeError(f"{r.request.method} {r.request.url.path} answered "
                           f"{r.status_code}: {r.text[:300]}")
    if phases is not None:
        phases.append(parse_server_timing(r.headers.get("server-timing", "")))
    return ms


def phase_p50s(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """p50 and sample count per phase over ``Server-Timing`` rows (ms); a phase missing
    from a row is left out of that phase, not counted as 0."""
    return {k: {"p50": s["p50"], "n": s["n"]} for k, s in phase_summaries(rows).items()}


def create(api: httpx.Client) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
    if r.status_code != 201:
        raise RuntimeError(f"create answered {r.status_code}: {r.text[:300]}")
    return r.json()["sandboxID"], (time.perf_counter() - t0) * 1000


def run_in(api: httpx.Client, srv: VMServer, sid: str, token: str | None, cmd: str) -> None:
    import asyncio

    from aenv.client.envd import EnvdClient

    async def go() -> None:
        envd = EnvdClient.through_proxy(srv.url, sid, token)
        try:
            r = await envd.run(cmd, timeout=30)
            if r.exit_code != 0:
                raise RuntimeError(f"{cmd!r} exited {r.exit_code}: {r.stderr}")
        finally:
            await envd.aclose()

    asyncio.run(go())


def started(api: httpx.Client, srv: VMServer, cmd: str) -> str:
    """A new sandbox from base that has run ``cmd``."""
    sid, _ = create(api)
    run_in(api, srv, sid, api.get(f"/sandboxes/{sid}").json().get("envdAccessToken"), cmd)
    return sid


def measure(srv: VMServer, n: int, forks: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"create_restore": [], "pause": [], "resume": [],
                                   "resume_busy": [], "snapshot": []}
    phases: dict[str, list[dict[str, float]]] = {"resume": [], "resume_busy": []}
    with srv.api() as api:
        # Warm-up: the first restore maps the snapshot cold. Deleted at once: a sandbox
        # left running would share the two cores with every figure below.
        warm, _ = create(api)
        expect_status(api.delete(f"/sandboxes/{warm}"), 204)
        sid, busy = started(api, srv, ticking("1")), started(api, srv, ticking("0.1"))
        for i in range(n):
            child, ms = create(api)
            out["create_restore"].append(ms)
            expect_status(api.delete(f"/sandboxes/{child}"), 204)
            out["pause"].append(timed(lambda: api.post(f"/sandboxes/{sid}/pause", json={}), 204))
            out["resume"].append(timed(
                lambda: api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 600}), 201,
                phases["resume"]))
            out["snapshot"].append(timed(
                lambda: api.post(f"/sandboxes/{sid}/snapshots", json={}), 201))
            timed(lambda: api.post(f"/sandboxes/{busy}/pause", json={}), 204)
            out["resume_busy"].append(timed(
                lambda: api.post(f"/v2/sandboxes/{busy}/connect", json={"timeout": 600}), 201,
                phases["resume_busy"]))
            log(f"round {i + 1}/{n}: create {out['create_restore'][-1]:.0f} ms, pause "
                f"{out['pause'][-1]:.0f}, resume {out['resume'][-1]:.0f} (busy "
                f"{out['resume_busy'][-1]:.0f}), snapshot {out['snapshot'][-1]:.0f}")
        # The resume sandboxes go first: the busy one alone keeps half a core busy, which
        # the forks below would otherwise share the host with.
        for s in (sid, busy):
            api.delete(f"/sandboxes/{s}")
        # Forks start from a fresh sandbox (restored from base), as an RL rollout does, not
        # from the one snapshotted above.
        for key, cmd in FORK_SOURCES.items():
            src = started(api, srv, cmd)
            phases[key] = []
            out[key] = fork_rounds(api, src, forks, key, phases[key])
            api.delete(f"/sandboxes/{src}")
        for s in api.get("/snapshots").json():
            api.delete(f"/templates/{s['snapshotID']}")
    return {**{k: summary(v) for k, v in out.items() if v},
            **{f"{k}_phases": phase_p50s(rows) for k, rows in phases.items() if rows}}


def fork_rounds(api: httpx.Client, src: str, rounds: int, key: str,
                phases: list[dict[str, float]]) -> list[float]:
    walls = []
    for i in range(rounds):
        t0 = time.perf_counter()
        r = api.post(f"/sandboxes/{src}/fork", json={"count": 16}, timeout=600)
        walls.append((time.perf_counter() - t0) * 1000)
        expect_status(r, 200, 201)
        phases.append(parse_server_timing(r.headers.get("server-timing", "")))
        results = r.json()
        failed = [x for x in results if "error" in x]
        log(f"{key} round {i + 1}: {walls[-1]:.0f} ms, {len(failed)} failed")
        if failed:
            raise RuntimeError(f"fork children failed: {failed[:3]}")
        for x in results:
            api.delete(f"/sandboxes/{x['sandbox']['sandboxID']}")
    return walls


def cold_creates(srv: VMServer, n: int) -> dict[str, float]:
    walls = []
    with srv.api() as api:
        for i in range(n):
            sid, ms = create(api)
            walls.append(ms)
            api.delete(f"/sandboxes/{sid}")
            log(f"cold create {i + 1}/{n}: {ms:.0f} ms")
    return summary(walls)


def with_server(home: Path, net: int, args: tuple[str, ...], fn: Callable[[VMServer], Any]):
    srv = VMServer(home, net, Settings.from_env().artifacts, server_args=args)
    try:
        log(f"starting aenv server {' '.join(args)} (prefix {srv.settings.name_prefix})")
        srv.start()
        return fn(srv)
    except BaseException:
        if srv.log_path.exists():
            log("server log tail:\n" + srv.log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        srv.shut_down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--forks", type=int, default=5, help="fork x16 rounds per source")
    ap.add_argument("--cold", type=int, default=5,
                    help="cold-boot creates for comparison (0: skip)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("sandbox_snapshots.py needs root (network namespaces, VMs)")
    result: dict[str, Any] = {"benchmark": "sandbox_snapshots", "n": args.n}
    result.update(with_server(Path(tempfile.mkdtemp(prefix="aenv-bench-snap-")), 92, (),
                              lambda s: measure(s, args.n, args.forks)))
    if args.cold > 0:
        result["create_cold"] = with_server(
            Path(tempfile.mkdtemp(prefix="aenv-bench-cold-")), 90, ("--no-snapshot-base",),
            lambda s: cold_creates(s, args.cold))
        result["create_restore_vs_cold_p50"] = round(
            result["create_restore"]["p50"] / result["create_cold"]["p50"], 3)
    emit(result)


if __name__ == "__main__":
    main()
