"""Soak: many pause/resume, snapshot and fork cycles of one sandbox, every state checked.

Run as root: ``.venv/bin/python benchmarks/soak.py [--cycles 1000] [--minutes M] [--seed S]``

Method: a real ``aenv server`` of its own (own home, prefix ``aenvsk``, 10.61.0.0/24 and
10.61.1.0/24, one warm slot; ``benchmarks/_soak.CrashableServer``), driven through the E2B
Python SDK. One sandbox from ``base`` runs the writer of ``benchmarks/_soak.py`` (a counter
and a checksummed file, ~20 lines a second). Each cycle picks, from a seeded RNG, one of:

- ``pause_resume``: ``pause()``, the API says paused, ``Sandbox.connect`` resumes it;
- ``snapshot``: ``create_snapshot()``, ``Sandbox.create(snapshot_id)``, the new sandbox is
  checked and killed, the snapshot deleted;
- ``fork``: ``fork(count=2..4)``, every child checked twice (see below) and killed.

Before each operation the source gets a fresh ``marker`` and loses its ``who`` file. After
it, every sandbox involved is read (``_soak.read_state``): the writer is alive with the same
pid, its in-memory digest equals the file's and both are the digest of ``1..n``, and the
counter is not below what the source showed before the operation. A child of a fork or a
sandbox from a snapshot must hold the source's marker (its state at capture time); each
child then writes its own ``who``, the source must not see any, and each child must read
back its own (they diverge). Every cycle also lists the run's sandboxes through the API (only
the source, running) and its snapshots (none). Any failed check is a *mismatch*; an
operation that raised is an *error* (the cycle then repairs: a new source if it is gone).

Every ``--audit-every`` cycles, and at the end, ``_soak.audit`` compares host and home with
the database (VMMs, VM dirs, guest-RAM files, netns, veths, nft tables, snapshot and layer
files, stuck records); the server's RSS and open descriptors are recorded too. At the end
the source is killed, the audit must be clean, the server is stopped and nothing of its
prefix may remain. Output: one JSON object: cycles done and their rate, mismatches,
errors, per-operation latency (ms: n, p50, p99, min, max; ``fork_<k>`` per count), the p50
of the first and last tenth of each operation's samples (drift), audits, leaks, host block.
TCG on 2 shared cores: figures are noisy; a mismatch or leak is not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, percentile, summary
from benchmarks._server import log
from benchmarks._soak import (
    Server,
    WriterState,
    add_server_args,
    audit,
    baseline,
    benchmark_server,
    log_excerpt,
    process_figures,
    read_state,
    sdk_opts,
    start_writer,
)

T = TypeVar("T")
OPERATIONS = ("pause_resume", "snapshot", "fork")
SOURCE_TTL_S = 24 * 3600
CHILD_TTL_S = 600


class Soak:
    """The cycles against one running server (started by the caller)."""

    def __init__(self, srv: Server, *, seed: int = 1, audit_every: int = 100,
                 server_pid: int | None = None) -> None:
        from e2b import Sandbox

        self.Sandbox = Sandbox
        self.srv = srv
        self.opts = sdk_opts(srv)
        self.rng = random.Random(seed)
        self.run_id = uuid.uuid4().hex[:12]
        self.meta = {"soak": self.run_id}
        self.audit_every = audit_every
        self.server_pid = server_pid
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.mismatches: list[dict[str, Any]] = []
        self.mismatch_count = 0
        self.errors: list[dict[str, Any]] = []
        self.error_count = 0
        self.leaked_records: list[str] = []
        self.ops: Counter[str] = Counter()
        self.audits: list[dict[str, Any]] = []
        self.transient: dict[str, list[str]] = defaultdict(list)
        self.sources = 0
        self.stalls = 0
        self.cycle = 0
        self.source: Any = None
        # The source's last state read, and the marker it holds since then (written by
        # that read, for the next capture).
        self.last: WriterState | None = None
        self.marker = ""
        self.markers = 0
        self.api = httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.api_key},
                                timeout=120)
        self.preexisting = baseline(srv.settings)

    # -- bookkeeping ----------------------------------------------------------------------

    def timed(self, key: str, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = fn()
        self.lat[key].append((time.perf_counter() - t0) * 1000)
        return out

    def check(self, op: str, sandbox: str, state: WriterState, **expect: Any) -> None:
        for problem in state.problems(**expect):
            self.mismatch(op, sandbox, problem)

    def mismatch(self, op: str, sandbox: str, problem: str) -> None:
        self.mismatch_count += 1
        log(f"cycle {self.cycle} {op}: MISMATCH {sandbox}: {problem}")
        if len(self.mismatches) < 50:
            self.mismatches.append({"cycle": self.cycle, "op": op, "sandbox": sandbox,
                                    "problem": problem})

    def error(self, op: str, e: BaseException, sandboxes: list[str]) -> None:
        self.error_count += 1
        log(f"cycle {self.cycle} {op}: ERROR {type(e).__name__}: {str(e)[:300]}")
        if len(self.errors) < 50:
            self.errors.append({"cycle": self.cycle, "op": op,
                                "error": f"{type(e).__name__}: {str(e)[:300]}",
                                "server_log": log_excerpt(self.srv.log_path, sandboxes)})

    # -- the source -----------------------------------------------------------------------

    def new_source(self) -> None:
        sbx = self.timed("create", lambda: self.Sandbox.create(
            "base", timeout=SOURCE_TTL_S, metadata=self.meta, **self.opts))
        self.sources += 1
        self.source = sbx
        first = start_writer(sbx)
        self.check("start", sbx.sandbox_id, first)
        self.last = self.read_source("start", floor=first.n, pid=first.pid)

    def read(self, op: str, sbx: Any, **kw: Any) -> WriterState:
        return self.timed("read_state", lambda: read_state(sbx, **kw))

    def read_source(self, op: str, **expect: Any) -> WriterState:
        """Read and check the source, and give it the marker of the next cycle."""
        self.markers += 1
        nxt = f"m{self.markers}-c{self.cycle}"
        st = self.read(op, self.source, then_marker=nxt)
        self.check(op, self.source.sandbox_id, st, **expect)
        self.marker = nxt
        return st

    # -- one cycle ------------------------------------------------------------------------

    def run_cycle(self) -> None:
        self.cycle += 1
        op = self.rng.choice(OPERATIONS)
        self.ops[op] += 1
        t0 = time.perf_counter()
        made: list[str] = []
        try:
            if self.source is None:
                self.new_source()
            assert self.last is not None
            pre, marker = self.last, self.marker
            getattr(self, op)(pre, marker, made)
            if self.last.n <= pre.n:
                self.stalls += 1
        except Exception as e:
            sid = self.source.sandbox_id if self.source is not None else ""
            self.error(op, e, [sid, *made])
            self.repair(made)
        else:
            self.lat[f"cycle_{op}"].append((time.perf_counter() - t0) * 1000)
        self.check_records(op)
        if self.audit_every and self.cycle % self.audit_every == 0:
            self.take_audit()

    def pause_resume(self, pre: WriterState, marker: str, made: list[str]) -> None:
        sid = self.source.sandbox_id
        self.timed("pause", self.source.pause)
        state = self.Sandbox.get_info(sid, **self.opts).state.value
        if state != "paused":
            self.mismatch("pause_resume", sid, f"after pause the API says {state}")
        self.source = self.timed("resume", lambda: self.Sandbox.connect(
            sid, timeout=SOURCE_TTL_S, **self.opts))
        self.last = self.read_source("pause_resume", floor=pre.n, pid=pre.pid, marker=marker,
                                     who="-")

    def snapshot(self, pre: WriterState, marker: str, made: list[str]) -> None:
        snap = self.timed("snapshot", self.source.create_snapshot)
        made.append(snap.snapshot_id)
        new = self.timed("create_from_snapshot", lambda: self.Sandbox.create(
            snap.snapshot_id, timeout=CHILD_TTL_S, metadata=self.meta, **self.opts))
        made.append(new.sandbox_id)
        got = self.read("snapshot", new, who="fromsnap")
        self.check("snapshot", new.sandbox_id, got, floor=pre.n, pid=pre.pid, marker=marker,
                   who="fromsnap")
        self.last = self.read_source("snapshot", floor=pre.n, pid=pre.pid, marker=marker,
                                     who="-")
        self.timed("kill", new.kill)
        self.timed("delete_snapshot", lambda: self.Sandbox.delete_snapshot(
            snap.snapshot_id, **self.opts))
        made.clear()

    def fork(self, pre: WriterState, marker: str, made: list[str]) -> None:
        sid = self.source.sandbox_id
        count = self.rng.randint(2, 4)
        self.ops[f"fork_{count}"] += 1
        t0 = time.perf_counter()
        results = self.source.fork(count=count, timeout=CHILD_TTL_S)
        ms = (time.perf_counter() - t0) * 1000
        self.lat["fork"].append(ms)
        self.lat[f"fork_{count}"].append(ms)
        children = [c for c in results if isinstance(c, self.Sandbox)]
        made.extend(c.sandbox_id for c in children)
        failed = [r for r in results if not isinstance(r, self.Sandbox)]
        for f in failed:
            self.error("fork", f, [sid])
        if len({c.sandbox_id for c in children} | {sid}) != len(children) + 1:
            self.mismatch("fork", sid, "children share an id with each other or the source")
        with concurrent.futures.ThreadPoolExecutor(max(len(children), 1)) as pool:
            first = list(pool.map(lambda ic: self.read("fork", ic[1], who=f"child{ic[0]}"),
                                  enumerate(children)))
            for i, (c, st) in enumerate(zip(children, first, strict=True)):
                self.check("fork", c.sandbox_id, st, floor=pre.n, pid=pre.pid, marker=marker,
                           who=f"child{i}")
            self.last = self.read_source("fork", floor=pre.n, pid=pre.pid, marker=marker,
                                         who="-")
            again = list(pool.map(lambda c: self.read("fork", c), children))
            for i, (c, st, st0) in enumerate(zip(children, again, first, strict=True)):
                self.check("fork", c.sandbox_id, st, floor=st0.n, pid=pre.pid, marker=marker,
                           who=f"child{i}")
            for c in children:
                self.timed("kill", c.kill)
        made.clear()

    def repair(self, made: list[str]) -> None:
        """After an error: drop what the cycle made, keep a running source."""
        for x in made:
            for path in (f"/sandboxes/{x}", f"/templates/{x}"):
                try:
                    self.api.delete(path)
                except httpx.HTTPError:
                    pass
        try:
            if self.source is not None:
                sid = self.source.sandbox_id
                r = self.api.get(f"/sandboxes/{sid}")
                if r.status_code == 200 and r.json().get("state") == "paused":
                    self.source = self.Sandbox.connect(sid, timeout=SOURCE_TTL_S, **self.opts)
                elif r.status_code != 200:
                    log(f"source {sid} is gone ({r.status_code}); starting a new one")
                    self.source = None
            if self.source is not None:
                self.last = self.read_source("repair")
        except Exception as e:
            log(f"repair: {type(e).__name__}: {e}; starting a new source")
            if self.source is not None:
                try:
                    self.api.delete(f"/sandboxes/{self.source.sandbox_id}")
                except httpx.HTTPError:
                    pass
            self.source = None

    def check_records(self, op: str) -> None:
        """Only the source is left of this run, running; it holds no snapshot."""
        listed = self.api.get("/v2/sandboxes",
                              params={"metadata": f"soak={self.run_id}", "limit": 100}).json()
        want = {self.source.sandbox_id} if self.source is not None else set()
        for s in listed:
            sid = s["sandboxID"]
            if sid not in want:
                self.leaked_records.append(f"cycle {self.cycle} ({op}): sandbox {sid} "
                                           f"{s.get('state')}")
                log(f"cycle {self.cycle}: LEAKED record {sid}, killing it")
                self.api.delete(f"/sandboxes/{sid}")
            elif s.get("state") != "running":
                self.mismatch(op, sid, f"source is {s.get('state')} between cycles")
        if self.source is not None:
            snaps = self.api.get("/snapshots",
                                 params={"sandboxID": self.source.sandbox_id}).json()
            for s in snaps:
                self.leaked_records.append(f"cycle {self.cycle} ({op}): snapshot "
                                           f"{s['snapshotID']}")
                self.api.delete(f"/templates/{s['snapshotID']}")

    def take_audit(self) -> dict[str, Any]:
        found = audit(self.srv.settings, settle_s=5, ignore=self.preexisting)
        entry = {"cycle": self.cycle, **found["counts"],
                 **(process_figures(self.server_pid) if self.server_pid else {}),
                 "problems": {k: len(v) for k, v in found["problems"].items() if v}}
        for k, v in found["problems"].items():
            self.transient[k].extend(f"cycle {self.cycle}: {x}" for x in v[:3])
        self.audits.append(entry)
        log(f"audit at cycle {self.cycle}: {entry}")
        return found

    # -- the end --------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Kill the source, audit, and return the figures (the server keeps running)."""
        # What the source's lineage holds on disk while it lives (collected at its kill).
        held = audit(self.srv.settings, settle_s=0, ignore=self.preexisting)
        retention = {"snapshot_entries": held["counts"]["snapshot_entries"],
                     "snapshots_mib": held["counts"]["snapshots_mib"],
                     "retained_unneeded": len(held["problems"]["snapshots_retained_unneeded"]),
                     "overlay_cache_entries": held["counts"]["overlay_cache_entries"]}
        if self.source is not None:
            try:
                self.timed("kill", self.source.kill)
            except Exception as e:
                self.error("final kill", e, [self.source.sandbox_id])
            self.source = None
        self.check_records("end")
        final = audit(self.srv.settings, ignore=self.preexisting)
        self.api.close()
        leaks = {k: v for k, v in final["problems"].items() if v}
        if self.leaked_records:
            leaks["records_left_by_cycles"] = self.leaked_records[:50]
        return {
            "cycles_done": self.cycle, "operations": dict(self.ops),
            "mismatches": self.mismatch_count, "mismatch_details": self.mismatches,
            "errors": self.error_count, "error_details": self.errors,
            "sources_created": self.sources, "counter_stalls": self.stalls,
            "latency_ms": {k: summary(v) for k, v in sorted(self.lat.items()) if v},
            "drift_p50_ms": drift(self.lat),
            "retention_before_final_kill": retention,
            "growth_per_cycle": growth(self.audits),
            "audits": self.audits,
            "transient_audit_findings": dict(self.transient),
            "final_audit_counts": final["counts"], "final_audit_notes": final["notes"],
            "leaks": leaks, "leak_count": sum(len(v) for v in leaks.values()),
            "preexisting_findings": sorted(f"{k}: {x}" for k, x in self.preexisting),
        }


def growth(audits: list[dict[str, Any]]) -> dict[str, float]:
    """Per cycle, between the first and the last audit, of what should stay flat while one
    sandbox cycles: files kept, the server's memory and descriptors."""
    if len(audits) < 2 or audits[-1]["cycle"] == audits[0]["cycle"]:
        return {}
    a, b = audits[0], audits[-1]
    span = b["cycle"] - a["cycle"]
    keys = ("snapshot_entries", "snapshots_mib", "overlay_cache_entries", "rss_kib", "fds",
            "vm_dirs", "netns")
    return {k: round((b[k] - a[k]) / span, 3) for k in keys if k in a and k in b}


def drift(lat: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """p50 of the first and of the last tenth of each operation's samples (at least 20)."""
    out = {}
    for k, v in sorted(lat.items()):
        if len(v) >= 20:
            tenth = max(len(v) // 10, 2)
            out[k] = {"first": round(percentile(v[:tenth], 50), 1),
                      "last": round(percentile(v[-tenth:], 50), 1), "n_each": tenth}
    return out


def run_soak(srv: Server, cycles: int, *, seed: int = 1, minutes: float | None = None,
             audit_every: int = 100, server_pid: int | None = None) -> dict[str, Any]:
    """``cycles`` cycles (or as many as fit in ``minutes``) against ``srv``, which the
    caller started and stops; returns the figures (no host block)."""
    soak = Soak(srv, seed=seed, audit_every=audit_every, server_pid=server_pid)
    t0 = time.monotonic()
    deadline = t0 + minutes * 60 if minutes else None
    try:
        while soak.cycle < cycles and (deadline is None or time.monotonic() < deadline):
            soak.run_cycle()
            if soak.cycle % 10 == 0:
                log(f"cycle {soak.cycle}: {dict(soak.ops)} mismatches {soak.mismatch_count} "
                    f"errors {soak.error_count} ({time.monotonic() - t0:.0f} s)")
    finally:
        wall = time.monotonic() - t0
        result = soak.finish()
    return {"cycles_requested": cycles, "wall_s": round(wall, 1),
            "cycles_per_min": round(soak.cycle / wall * 60, 2) if wall else 0.0, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop after this long even if fewer cycles are done")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--audit-every", type=int, default=100)
    add_server_args(ap, net=61, prefix="aenvsk")
    args = ap.parse_args()
    result: dict[str, Any] = {"benchmark": "soak", "seed": args.seed}
    with benchmark_server("soak.py", args, result) as srv:
        assert srv.proc is not None
        result.update(run_soak(srv, args.cycles, seed=args.seed, minutes=args.minutes,
                               audit_every=args.audit_every, server_pid=srv.proc.pid))
    emit(result)


if __name__ == "__main__":
    main()
