"""Kill loop: ``kill -9`` of the server inside an operation, restart, check what survived.

Run as root: ``.venv/bin/python benchmarks/kill_loop.py [--kills 50] [--seed 1]``

Method: a real ``aenv server`` of its own (own home, prefix ``aenvkl``, 10.63.0.0/24 and
10.63.1.0/24, one warm slot), driven through the E2B Python SDK. The loop keeps a small
population: running sandboxes, one paused sandbox, one persistent snapshot and, once one
was built, one template. Every sandbox holds a marker file and a background ``sleep`` whose
pid it recorded; a sandbox "is usable" when a command in it reads the marker and finds the
process alive. Each round, the operation comes from seeded shuffles of ``create``,
``pause``, ``resume``, ``snapshot``, ``fork`` (2 or 3 children) and ``template``
(``Template().from_template("base").run_cmd(...)`` built with ``Template.build``). It
starts in a thread; after a delay drawn from the seeded RNG, uniform between 0 and the
operation's typical duration (timed once per operation before the loop, uninterrupted, or
``DEFAULT_TYPICAL_S`` with ``--no-calibrate``), the server gets SIGKILL (its VMMs live on in
their own sessions). Once the client call has returned or failed, the server is started
again on the same home, and the round checks, each failure a *problem*:

- the audit of ``benchmarks/_soak.py``: no record left in a transitional state, no
  paused record without its snapshot, no build ``building``; no VMM, VM dir, guest-RAM file,
  netns, veth or nft table that no live record accounts for (VMMs neither adopted nor
  stopped); no snapshot or layer file unreachable from the records;
- the API lists exactly the live records of the database, in the states they map to;
- every sandbox that was paused before the kill resumes and is usable, every snapshot that
  existed makes a usable sandbox, every template that was ready makes a sandbox that holds
  what its build wrote, every running sandbox the operation did not touch is still running
  and usable (re-attached);
- the operation's own outcome is one the API explains: its sandbox running, paused or gone
  (a target that was running and is gone is reported as ``lost``, which the architecture
  allows; one that was paused and is gone is a problem); an operation whose answer the
  client had received before the kill must have stuck (a create, pause, resume, snapshot,
  fork or build that was acknowledged and then undone is a problem); children of a fork
  and a snapshot made before the kill are usable; a template is ready, failed, or
  ``waiting`` (a reservation never started, kept until E2B's 40-minute deadline, noted).

Output: one JSON object: kills, per operation (kills, acknowledged before the kill, what
the server showed after, the delays), ``restart_s`` (spawn to ``/health``: the server's
recovery) and ``recovered_s`` (to the end of the round's checks) as n/p50/p99 in seconds,
lost sandboxes, problems with server log excerpts, notes, final audit, host block.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit, summary
from benchmarks._server import log
from benchmarks._soak import (
    Server,
    add_server_args,
    audit,
    baseline,
    benchmark_server,
    log_excerpt,
    log_size,
    sdk_opts,
)

OPERATIONS = ("create", "pause", "resume", "snapshot", "fork", "template")
DEFAULT_TYPICAL_S = {"create": 0.4, "pause": 0.2, "resume": 0.4, "snapshot": 0.2,
                     "fork": 1.5, "template": 6.0}
TTL_S = 3600
MARKER = "/home/user/kl"
SLEEPER = "/home/user/kl.pid"
BUILT = "/home/user/built"


@dataclass
class Attempt:
    """One operation started in a thread."""

    op: str
    fn: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done_at: float | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        def run() -> None:
            try:
                self.result = self.fn()
            except BaseException as e:
                self.error = e
            self.done_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True, name=f"kl-{self.op}")
        self.thread.start()


@dataclass
class Population:
    running: dict[str, str] = field(default_factory=dict)  # sandbox id -> marker
    paused: dict[str, str] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)  # snapshot id -> marker
    templates: list[str] = field(default_factory=list)  # names of ready templates


class KillLoop:
    def __init__(self, srv: Server, *, seed: int = 1, running: int = 2,
                 typical: dict[str, float] | None = None) -> None:
        from e2b import Sandbox, Template

        self.Sandbox, self.Template = Sandbox, Template
        self.srv = srv
        self.rng = random.Random(seed)
        self.run_id = uuid.uuid4().hex[:10]
        self.want_running = running
        self.typical = dict(typical or DEFAULT_TYPICAL_S)
        self.pop = Population()
        self.kills = 0
        self.problems: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.rounds: list[dict[str, Any]] = []
        self.restart_s: list[float] = []
        self.recovered_s: list[float] = []
        self.per_op: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"kills": 0, "acknowledged": 0, "outcomes": Counter(), "delays_ms": []})
        self.schedule: list[str] = []
        self.labels: dict[str, str] = {}  # sandbox id -> its "sbx" metadata label
        self._labels = 0
        self._since = 0
        self.api = self._api()
        self.preexisting = baseline(srv.settings)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def opts(self) -> dict[str, Any]:
        return sdk_opts(self.srv)

    def _api(self) -> httpx.Client:
        return httpx.Client(base_url=self.srv.url, headers={"X-API-KEY": self.srv.api_key},
                            timeout=120)

    def label(self) -> str:
        self._labels += 1
        return f"{self.run_id}-{self._labels}"

    def problem(self, op: str, kind: str, detail: str, ids: list[str]) -> None:
        log(f"kill {self.kills} ({op}): PROBLEM {kind}: {detail}")
        self.problems.append({
            "kill": self.kills, "op": op, "kind": kind, "detail": detail[:500],
            "server_log": log_excerpt(self.srv.log_path, ids, since=self._since)})

    def next_op(self) -> str:
        if not self.schedule:
            block = list(OPERATIONS)
            self.rng.shuffle(block)
            self.schedule = block
        return self.schedule.pop(0)

    # -- sandboxes ------------------------------------------------------------------------

    def new_sandbox(self, template: str = "base") -> tuple[str, str]:
        """A running sandbox with a marker and a recorded background process."""
        label = self.label()
        sbx = self.Sandbox.create(template, timeout=TTL_S,
                                  metadata={"kl": self.run_id, "sbx": label}, **self.opts)
        marker = f"m-{label}"
        self.mark(sbx, marker)
        self.labels[sbx.sandbox_id] = label
        return sbx.sandbox_id, marker

    def mark(self, sbx: Any, marker: str) -> None:
        sbx.commands.run(f"echo {marker} > {MARKER}; nohup sleep 1000000 </dev/null "
                         f">/dev/null 2>&1 & echo $! > {SLEEPER}", timeout=60)

    def usable(self, sbx: Any, marker: str) -> str | None:
        """None when ``sbx`` holds ``marker`` and its background process lives, else what
        is wrong."""
        out = sbx.commands.run(f"cat {MARKER}; if [ -d /proc/$(cat {SLEEPER}) ]; then "
                               "echo alive; else echo dead; fi", timeout=60).stdout.split()
        if out != [marker, "alive"]:
            return f"read {out}, expected [{marker!r}, 'alive']"
        return None

    def connect_usable(self, sid: str, marker: str) -> str | None:
        try:
            return self.usable(self.Sandbox.connect(sid, timeout=TTL_S, **self.opts), marker)
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:300]}"

    def snapshot_usable(self, snap_id: str, marker: str) -> str | None:
        try:
            sbx = self.Sandbox.create(snap_id, timeout=600, metadata={"kl": self.run_id},
                                      **self.opts)
        except Exception as e:
            return f"create from it: {type(e).__name__}: {str(e)[:300]}"
        try:
            return self.usable(sbx, marker)
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            self.kill(sbx.sandbox_id)

    def template_usable(self, name: str) -> str | None:
        try:
            sbx = self.Sandbox.create(name, timeout=600, metadata={"kl": self.run_id},
                                      **self.opts)
        except Exception as e:
            return f"create from it: {type(e).__name__}: {str(e)[:300]}"
        try:
            out = sbx.commands.run(f"cat {BUILT}", timeout=60).stdout.strip()
            return None if out == "hi" else f"{BUILT} holds {out!r}"
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            self.kill(sbx.sandbox_id)

    def kill(self, sid: str) -> None:
        try:
            self.api.delete(f"/sandboxes/{sid}")
        except httpx.HTTPError as e:
            log(f"kill {sid}: {e}")

    def state(self, sid: str) -> str:
        """The API's state of a sandbox: running, paused, or gone."""
        r = self.api.get(f"/sandboxes/{sid}")
        if r.status_code == 404:
            return "gone"
        r.raise_for_status()
        return r.json()["state"]

    def labelled(self, label: str) -> list[dict[str, Any]]:
        return self.api.get("/v2/sandboxes", params={"metadata": f"sbx={label}",
                                                     "limit": 100}).json()

    def build_template(self, name: str) -> Any:
        t = self.Template().from_template("base").run_cmd(f"echo hi > {BUILT}")
        return self.Template.build(t, name, **self.opts)

    # -- the population -------------------------------------------------------------------

    def settle_population(self) -> None:
        """Back to the wanted sizes: running, one paused, one snapshot, one template."""
        p = self.pop
        while len(p.running) < self.want_running + (0 if p.paused else 1):
            sid, marker = self.new_sandbox()
            p.running[sid] = marker
        if not p.paused:
            sid = next(iter(p.running))
            self.Sandbox.pause(sid, **self.opts)
            p.paused[sid] = p.running.pop(sid)
        while len(p.running) > self.want_running:
            sid = next(iter(p.running))
            self.kill(sid)
            del p.running[sid]
        if not p.snapshots:
            sid = next(iter(p.running))
            snap = self.Sandbox.create_snapshot(sid, **self.opts)
            p.snapshots[snap.snapshot_id] = p.running[sid]
        while len(p.snapshots) > 1:
            self.api.delete(f"/templates/{next(iter(p.snapshots))}")
            del p.snapshots[next(iter(p.snapshots))]
        while len(p.templates) > 1:
            self.api.delete(f"/templates/{p.templates.pop(0)}")

    # -- one round ------------------------------------------------------------------------

    def prepare(self, op: str) -> tuple[Attempt, dict[str, Any]]:
        """The operation to interrupt, and what the round must know to judge it."""
        p, opts = self.pop, self.opts
        ctx: dict[str, Any] = {"op": op}
        if op == "create":
            label = self.label()
            ctx["label"] = label
            return Attempt(op, lambda: self.Sandbox.create(
                "base", timeout=TTL_S, metadata={"kl": self.run_id, "sbx": label},
                **opts)), ctx
        if op == "resume":
            sid, marker = p.paused.popitem()
            ctx.update(sid=sid, marker=marker, was="paused")
            return Attempt(op, lambda: self.Sandbox.connect(sid, timeout=TTL_S, **opts)), ctx
        if op == "template":
            name = f"kl-{self.label()}"
            ctx["name"] = name
            return Attempt(op, lambda: self.build_template(name)), ctx
        sid = next(iter(p.running))
        marker = p.running.pop(sid)
        ctx.update(sid=sid, marker=marker, was="running")
        if op == "pause":
            return Attempt(op, lambda: self.Sandbox.pause(sid, **opts)), ctx
        if op == "snapshot":
            return Attempt(op, lambda: self.Sandbox.create_snapshot(sid, **opts)), ctx
        assert op == "fork"
        count = self.rng.randint(2, 3)
        ctx.update(count=count, label=self.labels[sid])
        return Attempt(op, lambda: self.Sandbox.fork(sid, count=count, timeout=600,
                                                     **opts)), ctx

    def round(self) -> None:
        op = self.next_op()
        self.kills += 1
        self.settle_population()
        attempt, ctx = self.prepare(op)
        delay = self.rng.uniform(0, self.typical[op])
        self._since = log_size(self.srv.log_path)
        attempt.start()
        time.sleep(delay)
        self.srv.kill9()
        assert attempt.thread is not None
        attempt.thread.join(60)
        if attempt.thread.is_alive():
            self.notes.append(f"kill {self.kills} ({op}): the client call was still running "
                              "60 s after the kill")
        acked = attempt.error is None and attempt.done_at is not None
        stats = self.per_op[op]
        stats["kills"] += 1
        stats["acknowledged"] += acked
        stats["delays_ms"].append(delay * 1000)
        log(f"kill {self.kills}: {op} after {delay * 1000:.0f} ms "
            f"({'acknowledged' if acked else 'interrupted'})")

        t0 = time.monotonic()
        self.srv.start()
        self.restart_s.append(time.monotonic() - t0)
        self.api.close()
        self.api = self._api()
        before = Population(dict(self.pop.running), dict(self.pop.paused),
                            dict(self.pop.snapshots), list(self.pop.templates))
        self.check_records(op)
        self.check_population(op, before)
        outcome = self.check_outcome(op, ctx, attempt, acked)
        stats["outcomes"][outcome] += 1
        self.recovered_s.append(time.monotonic() - t0)
        self.rounds.append({"kill": self.kills, "op": op, "delay_ms": round(delay * 1000, 1),
                            "acknowledged": acked, "outcome": outcome,
                            "restart_s": round(self.restart_s[-1], 2),
                            "recovered_s": round(self.recovered_s[-1], 2)})
        log(f"kill {self.kills}: {op} -> {outcome}; restart {self.restart_s[-1]:.1f} s, "
            f"checked {self.recovered_s[-1]:.1f} s; problems so far {len(self.problems)}")

    def check_records(self, op: str) -> None:
        found = audit(self.srv.settings, ignore=self.preexisting)
        for kind, items in found["problems"].items():
            if len(items) > 3:  # one entry for many alike
                self.problem(op, kind, f"{len(items)}, e.g. {items[:3]}", [])
                continue
            for item in items:
                self.problem(op, kind, item, re.findall(r"\b[a-z0-9]{20}\b", item) or [item])
        for item in found["notes"]["waiting_builds"]:
            note = f"kill {self.kills} ({op}): {item} waiting (reservation never started)"
            if note not in self.notes:
                self.notes.append(note)
        listed = {s["sandboxID"]: s["state"]
                  for s in self.api.get("/v2/sandboxes", params={"limit": 100}).json()}
        from aenv.api.views import api_state
        from aenv.store import Database, SandboxStore

        db = Database(self.srv.settings.home / "aenv.db")
        try:
            live = {r.id: (r.state, api_state(r)) for r in SandboxStore(db).live()}
        finally:
            db.close()
        for sid in set(listed) | set(live):
            state, want = live.get(sid, ("absent", "absent"))
            if listed.get(sid, "absent") != want:
                self.problem(op, "api_db_mismatch", f"{sid}: API {listed.get(sid, 'absent')}, "
                             f"database {state}", [sid])

    def check_population(self, op: str, before: Population) -> None:
        """Everything that existed before the kill and that the operation did not touch."""
        p = self.pop
        for sid, marker in before.paused.items():
            if (bad := self.connect_usable(sid, marker)) is not None:
                self.problem(op, "paused_sandbox_unusable", f"{sid}: {bad}", [sid])
                del p.paused[sid]
                self.kill(sid)
            else:  # resumed by the check: running now
                p.running[sid] = p.paused.pop(sid)
        for sid, marker in before.running.items():
            st = self.state(sid)
            if st != "running":
                self.problem(op, "bystander_not_running", f"{sid} is {st} after the restart",
                             [sid])
            if st == "gone":
                del p.running[sid]
                continue
            if (bad := self.connect_usable(sid, marker)) is not None:
                self.problem(op, "bystander_unusable", f"{sid}: {bad}", [sid])
                del p.running[sid]
                self.kill(sid)
        for snap, marker in before.snapshots.items():
            if (bad := self.snapshot_usable(snap, marker)) is not None:
                self.problem(op, "snapshot_unusable", f"{snap}: {bad}", [snap])
                del p.snapshots[snap]
        for name in before.templates:
            if (bad := self.template_usable(name)) is not None:
                self.problem(op, "template_unusable", f"{name}: {bad}", [name])
                p.templates.remove(name)

    def check_outcome(self, op: str, ctx: dict[str, Any], attempt: Attempt,
                      acked: bool) -> str:
        """Judge the interrupted operation; put what it left into the population."""
        p = self.pop
        if op == "create":
            found = self.labelled(ctx["label"])
            if not found:
                if acked:
                    self.problem(op, "acknowledged_create_undone",
                                 f"create answered {attempt.result.sandbox_id} and it is gone",
                                 [attempt.result.sandbox_id])
                return "gone"
            for s in found:
                sid = s["sandboxID"]
                try:
                    sbx = self.Sandbox.connect(sid, timeout=TTL_S, **self.opts)
                    marker = f"m-{ctx['label']}"
                    self.mark(sbx, marker)
                    if (bad := self.usable(sbx, marker)) is not None:
                        raise RuntimeError(bad)
                    p.running[sid] = marker
                    self.labels[sid] = ctx["label"]
                except Exception as e:
                    self.problem(op, "created_sandbox_unusable", f"{sid}: {e}", [sid])
                    self.kill(sid)
            return "running" if len(found) == 1 else f"{len(found)} sandboxes"
        if op == "template":
            return self.template_outcome(ctx["name"], acked)
        sid, marker = ctx["sid"], ctx["marker"]
        st = self.state(sid)
        if st == "gone":
            if ctx["was"] == "paused":
                self.problem(op, "paused_sandbox_gone", f"{sid} was paused before the kill",
                             [sid])
            else:
                self.lost.append({"kill": self.kills, "op": op, "sandbox": sid,
                                  "server_log": log_excerpt(self.srv.log_path, [sid],
                                                            since=self._since)})
        want = {"pause": "paused", "resume": "running"}.get(op)
        if acked and want and st != want:
            self.problem(op, f"acknowledged_{op}_undone", f"{sid} is {st} after the restart",
                         [sid])
        outcome = st
        if st != "gone":
            if (bad := self.connect_usable(sid, marker)) is not None:
                self.problem(op, "target_unusable", f"{sid} ({st}): {bad}", [sid])
                self.kill(sid)
            else:
                p.running[sid] = marker
        if op == "snapshot":
            snaps = self.api.get("/snapshots", params={"sandboxID": sid}).json()
            if acked and attempt.result.snapshot_id not in {s["snapshotID"] for s in snaps}:
                self.problem(op, "acknowledged_snapshot_undone",
                             f"snapshot {attempt.result.snapshot_id} of {sid} is gone",
                             [sid, attempt.result.snapshot_id])
            for s in snaps:
                if (bad := self.snapshot_usable(s["snapshotID"], marker)) is not None:
                    self.problem(op, "new_snapshot_unusable", f"{s['snapshotID']}: {bad}",
                                 [s["snapshotID"], sid])
                else:
                    p.snapshots[s["snapshotID"]] = marker
            outcome += f", {len(snaps)} snapshot" + ("s" if len(snaps) != 1 else "")
        if op == "fork":
            children = [s["sandboxID"] for s in self.labelled(ctx["label"])
                        if s["sandboxID"] != sid]
            if acked:
                made = [c.sandbox_id for c in attempt.result
                        if isinstance(c, self.Sandbox)]
                gone = [c for c in made if c not in children]
                if gone:
                    self.problem(op, "acknowledged_fork_child_undone",
                                 f"children {gone} of {sid} are gone", [sid, *gone])
            for c in children:
                if (bad := self.connect_usable(c, marker)) is not None:
                    self.problem(op, "fork_child_unusable", f"{c}: {bad}", [c, sid])
                self.kill(c)
            outcome += f", {len(children)}/{ctx['count']} children"
        return outcome

    def template_outcome(self, name: str, acked: bool) -> str:
        r = self.api.get(f"/templates/{name}")
        if r.status_code == 404:
            if acked:
                self.problem("template", "acknowledged_build_undone", f"{name} is gone", [name])
            return "absent"
        status = r.json()["buildStatus"]
        if status == "ready":
            if (bad := self.template_usable(name)) is not None:
                self.problem("template", "new_template_unusable", f"{name}: {bad}", [name])
            else:
                self.pop.templates.append(name)
        elif acked:
            self.problem("template", "acknowledged_build_undone",
                         f"{name} is {status} after the restart", [name])
        elif status in ("building",):
            pass  # the audit reports it
        else:
            self.api.delete(f"/templates/{r.json()['templateID']}")
        return status

    # -- calibration and the end ----------------------------------------------------------

    def calibrate(self) -> dict[str, float]:
        """Time each operation once, uninterrupted: the range the kill delays come from."""
        self.settle_population()
        out = {}
        for op in OPERATIONS:
            self.settle_population()
            attempt, ctx = self.prepare(op)
            t0 = time.monotonic()
            attempt.start()
            assert attempt.thread is not None
            attempt.thread.join(300)
            if attempt.error is not None:
                raise RuntimeError(f"calibrating {op}: {attempt.error!r}")
            out[op] = round(time.monotonic() - t0, 3)
            self.absorb(op, ctx, attempt)
            log(f"calibration: {op} takes {out[op] * 1000:.0f} ms")
        self.typical = out
        return out

    def absorb(self, op: str, ctx: dict[str, Any], attempt: Attempt) -> None:
        """Put what an uninterrupted operation made into the population (or drop it)."""
        p = self.pop
        if op == "create":
            self.kill(attempt.result.sandbox_id)
        elif op == "template":
            p.templates.append(ctx["name"])
        elif op == "pause":
            p.paused[ctx["sid"]] = ctx["marker"]
        else:
            p.running[ctx["sid"]] = ctx["marker"]
            if op == "snapshot":
                p.snapshots[attempt.result.snapshot_id] = ctx["marker"]
            if op == "fork":
                for c in attempt.result:
                    if isinstance(c, self.Sandbox):
                        self.kill(c.sandbox_id)

    def finish(self) -> dict[str, Any]:
        """Kill and delete everything of the run, audit, and return the figures."""
        for s in self.api.get("/v2/sandboxes", params={"limit": 100}).json():
            self.kill(s["sandboxID"])
        for snap in self.api.get("/snapshots", params={"limit": 100}).json():
            self.api.delete(f"/templates/{snap['snapshotID']}")
        for t in self.api.get("/templates").json():
            if t["templateID"] != "base":
                self.api.delete(f"/templates/{t['templateID']}")
        final = audit(self.srv.settings, ignore=self.preexisting)
        self.api.close()
        per_op = {op: {"kills": s["kills"], "acknowledged": s["acknowledged"],
                       "outcomes": dict(s["outcomes"]),
                       "delay_ms": summary(s["delays_ms"]) if s["delays_ms"] else None}
                  for op, s in sorted(self.per_op.items())}
        kinds = Counter(p["kind"] for p in self.problems)
        return {
            "kills": self.kills, "typical_s": self.typical, "per_operation": per_op,
            "restart_s": _seconds(self.restart_s), "recovered_s": _seconds(self.recovered_s),
            "problems": len(self.problems), "problem_kinds": dict(kinds),
            "problem_details": self.problems[:60], "lost": self.lost, "notes": self.notes,
            "rounds": self.rounds,
            "preexisting_findings": sorted(f"{k}: {x}" for k, x in self.preexisting),
            "final_audit": {"problems": {k: v for k, v in final["problems"].items() if v},
                            "notes": final["notes"], "counts": final["counts"]},
        }


def _seconds(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    s = summary([v * 1000 for v in values])
    return {"n": s["n"], **{k: None if s[k] is None else round(s[k] / 1000, 3)
                            for k in ("p50", "p99", "min", "max")}}


def run_kill_loop(srv: Server, kills: int, *, seed: int = 1, calibrate: bool = True,
                  running: int = 2) -> dict[str, Any]:
    """``kills`` rounds against ``srv`` (started by the caller, running again on return);
    returns the figures (no host block)."""
    loop = KillLoop(srv, seed=seed, running=running)
    t0 = time.monotonic()
    try:
        if calibrate:
            loop.calibrate()
        while loop.kills < kills:
            loop.round()
    finally:
        wall = time.monotonic() - t0
        try:
            result = loop.finish()
        except Exception as e:  # the server may be down if a round failed mid-way
            log(f"finish: {type(e).__name__}: {e}")
            result = {"kills": loop.kills, "problems": len(loop.problems),
                      "problem_details": loop.problems, "finish_error": repr(e)}
    return {"kills_requested": kills, "seed": seed, "wall_s": round(wall, 1), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-calibrate", action="store_true",
                    help=f"kill delays from DEFAULT_TYPICAL_S {DEFAULT_TYPICAL_S}")
    add_server_args(ap, net=63, prefix="aenvkl")
    args = ap.parse_args()
    result: dict[str, Any] = {"benchmark": "kill_loop"}
    with benchmark_server("kill_loop.py", args, result, restart_crashed=True) as srv:
        result.update(run_kill_loop(srv, args.kills, seed=args.seed,
                                    calibrate=not args.no_calibrate))
    emit(result)


if __name__ == "__main__":
    main()
