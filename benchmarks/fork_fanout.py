"""Fork fan-out (issue 21 item 2): ``fork x16`` through the REST API, this tree against a
baseline tree, side by side, with where each fork's time and CPU went.

Run as root: ``.venv/bin/python benchmarks/fork_fanout.py [--baseline-tree DIR] [--rounds 5]
[--count 16] [--net 196]``

Method: one ``aenv server`` of this tree (``benchmarks/_server.py``, net ``--net`` + 1) and,
with ``--baseline-tree`` (e.g. ``git worktree add /tmp/forkbase <rev>``), one of that tree
(net ``--net``). Each round, for each source kind, the servers take turns (the order swaps
every round): a fresh sandbox from ``base`` (a restore, as an RL rollout's) runs the
source's command, the server is left to go quiet, then ``POST /sandboxes/{id}/fork
{"count": N}`` is timed by the client until its answer (every child restored and its envd
``/init`` answered); children and source are killed after. Sources: ``quiet`` holds a file;
``busy`` also runs a loop that execs two programs every 0.1 s (under TCG, half a core per
guest once the children run it too).

Per fork, besides the wall time: its ``Server-Timing`` (``capture``, ``children``, the median
and slowest child per phase); the CPU seconds the server process spent during it
(``server_cpu_s``: all its threads, so the event loop, the blocking-call threads and what
it spawned and reaped); the CPU of the children's VMMs from their start to the answer
(``vmm_cpu_s``: the guests' execution under TCG plus QEMU's own); that of the server's
other VMMs (the source's, pooled ones); and the host's busy CPU over the fork
(``host_busy_cpu_s``, all processes, other sessions' too).
On 2 cores a fork of wall W has 2W CPU seconds: what the VMMs took is what KVM shrinks,
what the server took is ours.

Measured 2026-12-06 (TCG, 512 MiB guests; the host shared with other sessions at load ~30,
busy 99 %, so walls of 8-14 s p50 say more about that load than about the fork; CPU seconds
do not): per fork x16 the children's VMMs used 5.3 s (quiet source) and 6.3 s (busy), of
which QEMU's own start-up is ~16 x 20-40 ms (what a pre-started VMM has used while it
waits) and the rest the guests running until /init is answered; the server used 0.85-0.92
s before 1a05658 and 0.58-0.63 s after (its slot refill no longer runs inside the fork),
of which the event loop's thread, the one serial part, 0.21-0.24 s (per-thread CPU from
/proc/PID/task, a quiet and a busy fork each); the capture 0.14-0.26 s. On an idle 2-core
host that puts a fork x16 at ~3 s at best under TCG, whatever the server does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from aenv.orchestrator.timing import parse_server_timing
from benchmarks._common import emit, expect_status, phase_summaries, summary
from benchmarks._server import VMServer, log
from benchmarks.sandbox_snapshots import STATE, run_in, ticking

SOURCES = {"quiet": STATE, "busy": ticking("0.1")}
TICK = os.sysconf("SC_CLK_TCK")
SETTLE_MAX_S = 15.0  # the longest wait for a server to go quiet before a fork


def _proc_cpu(pid: int, *, children: bool = False) -> float:
    """CPU seconds of ``pid`` (utime + stime; with ``children``, also what it reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def _host_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4] - v[7]) / TICK


def _vmm_pids(srv: VMServer) -> dict[str, int]:
    """The server's VMM processes by working directory name (sandbox id or pool entry)."""
    root = str(srv.settings.vms_dir.resolve()) + os.sep
    out = {}
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{e.name}/cwd")
        except OSError:
            continue
        if (cwd + os.sep).startswith(root):
            out[Path(cwd).name] = int(e.name)
    return out


def _settle(srv: VMServer, pid: int) -> None:
    """Wait until the server used under 5 % of a core for 0.5 s (its slot pool refilled,
    the VMs of the last round reaped), at most ``SETTLE_MAX_S``."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        before = _proc_cpu(pid, children=True)
        time.sleep(0.5)
        if _proc_cpu(pid, children=True) - before < 0.025:
            return


class Side:
    """One server under test and what its forks measured."""

    def __init__(self, name: str, srv: VMServer) -> None:
        self.name = name
        self.srv = srv
        self.walls: dict[str, list[float]] = {k: [] for k in SOURCES}
        self.phases: dict[str, list[dict[str, float]]] = {k: [] for k in SOURCES}
        self.cpu: dict[str, list[dict[str, float]]] = {k: [] for k in SOURCES}

    def fork_once(self, kind: str, count: int) -> None:
        srv = self.srv
        assert srv.proc is not None
        pid = srv.proc.pid
        with srv.api() as api:
            r = expect_status(api.post("/v2/sandboxes", json={"templateID": "base",
                                                              "timeout": 600}), 201)
            src = r.json()["sandboxID"]
            token = api.get(f"/sandboxes/{src}").json().get("envdAccessToken")
            run_in(api, srv, src, token, SOURCES[kind])
            _settle(srv, pid)
            before = set(_vmm_pids(srv).items())
            # The source's VMM (a pooled one's directory is not named after it) and the
            # pooled VMMs waiting: their CPU over the fork.
            others = {pid: _proc_cpu(pid) for _, pid in before}
            cpu0, host0 = _proc_cpu(pid, children=True), _host_busy_s()
            t0 = time.perf_counter()
            r = api.post(f"/sandboxes/{src}/fork", json={"count": count}, timeout=600)
            wall = (time.perf_counter() - t0) * 1000
            cpu1, host1 = _proc_cpu(pid, children=True), _host_busy_s()
            expect_status(r, 200, 201)
            new = [p for name_pid in _vmm_pids(srv).items() if name_pid not in before
                   for p in (name_pid[1],)]
            vmm_cpu = sum(_proc_cpu(p) for p in new)
            others_cpu = sum(_proc_cpu(p) - c for p, c in others.items())
            results = r.json()
            failed = [x for x in results if "error" in x]
            for x in results:
                if "sandbox" in x:
                    api.delete(f"/sandboxes/{x['sandbox']['sandboxID']}")
            api.delete(f"/sandboxes/{src}")
        if failed:
            raise RuntimeError(f"{self.name}: fork children failed: {failed[:3]}")
        self.walls[kind].append(wall)
        self.phases[kind].append(parse_server_timing(r.headers.get("server-timing", "")))
        self.cpu[kind].append({"server_cpu_s": cpu1 - cpu0, "vmm_cpu_s": vmm_cpu,
                               "source_and_pooled_vmms_cpu_s": others_cpu,
                               "host_busy_cpu_s": host1 - host0, "wall_s": wall / 1000})
        log(f"{self.name} {kind} fork x{count}: {wall:.0f} ms, server CPU "
            f"{cpu1 - cpu0:.2f} s, children's VMMs {vmm_cpu:.2f} s, host busy "
            f"{host1 - host0:.2f} s")

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind in SOURCES:
            if not self.walls[kind]:
                continue
            cpu = self.cpu[kind]
            out[kind] = {
                "wall_ms": summary(self.walls[kind]),
                "phases_ms": {k: {"p50": s["p50"], "max": s["max"], "n": s["n"]}
                              for k, s in phase_summaries(self.phases[kind]).items()},
                "cpu_s": {k: {"p50": round(s["p50"] / 1000, 3), "n": s["n"]}
                          for k, s in phase_summaries(
                              [{k: v * 1000 for k, v in c.items()} for c in cpu]).items()},
            }
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="source tree to compare against (e.g. a worktree of the start rev)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--net", type=int, default=196,
                    help="the baseline's net (10.NET.0.0/24); this tree's is NET + 1")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help="comma-separated source kinds: " + ", ".join(SOURCES))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("fork_fanout.py needs root (network namespaces, VMs)")
    kinds = [k for k in args.sources.split(",") if k]
    cache = Settings.from_env().artifacts
    sides: list[Side] = []
    max_sb = str(2 * args.count + 8)
    try:
        if args.baseline_tree is not None:
            sides.append(Side("baseline", VMServer(
                Path(tempfile.mkdtemp(prefix="aenv-bench-fkb-")), args.net, cache,
                letters="fb", tree=args.baseline_tree.resolve(),
                server_args=("--max-sandboxes", max_sb))))
        sides.append(Side("this", VMServer(
            Path(tempfile.mkdtemp(prefix="aenv-bench-fkn-")), args.net + 1, cache,
            letters="fn", server_args=("--max-sandboxes", max_sb))))
        for s in sides:
            log(f"starting the {s.name} server (prefix {s.srv.settings.name_prefix})")
            s.srv.start()
        for i in range(args.rounds):
            order = sides if i % 2 == 0 else sides[::-1]
            for kind in kinds:
                for s in order:
                    s.fork_once(kind, args.count)
            log(f"round {i + 1}/{args.rounds} done")
    except BaseException:
        for s in sides:
            if s.srv.log_path.exists():
                log(f"{s.name} server log tail:\n"
                    + s.srv.log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        for s in sides:
            left = s.srv.shut_down()
            if any(left.values()):
                log(f"{s.name}: leftovers were swept: {left}")
    result: dict[str, Any] = {
        "benchmark": "fork_fanout", "count": args.count, "rounds": args.rounds,
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        **{s.name: s.result() for s in sides}}
    emit(result)


if __name__ == "__main__":
    main()
