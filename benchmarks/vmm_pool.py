"""Creates from a template with and without pre-started VMMs, split into the host's share and
the guest's, side by side in one run (issue 21).

Run as root: ``.venv/bin/python benchmarks/vmm_pool.py [--n 20] [--forks 5] [--net 107]``

Method: two ``aenv server`` processes at once, each with its own home, prefix and address
ranges, sharing the kernel and image cache (``benchmarks/_server.py``): "off" with
``AENV_VMM_POOL_SIZE=0`` (every create restores base's snapshot into a VMM started for it)
and "on" with the pool (``--pool-size``, default 4). Every operation is run on one server
then the other, the order swapped each round, so both see the same host (other sessions'
VMs come and go on these 2 cores). Over one keep-alive connection per server (httpx):

- ``create``: ``--n`` rounds of ``POST /v2/sandboxes`` from ``base``, each followed by its
  ``DELETE`` and ``--gap`` seconds of quiet (the time between bursts in which the pool
  refills; the same in both modes), after one warm-up create left out of the figures;
  ``create_host``: the ``host`` total of its ``Server-Timing`` (every phase but the
  guest's: api, orchestrator, slot, prepare, vmm, memory, state_load or pool), and
  ``create_guest``: ``envd_init`` (the guest runs from its restored state until envd has
  answered ``/init``: what TCG emulates and KVM runs natively); ``pool_hits``: creates
  that took a pre-started VMM (their Server-Timing has ``pool``); ``init_again``: the
  same ``/init`` sent again right after (as the node sends it), to a guest whose code TCG
  has translated by then — how much of ``create_guest`` is a cold guest;
- ``resume``: pause (``POST .../pause``), ``--resume-after`` seconds, then ``POST
  /v2/.../connect`` of one sandbox, ``--n`` times; with the pool on, the node pre-starts a
  VMM for the paused sandbox after the pause (one, for 60 s), which the resume takes;
- ``fork16``: ``POST .../fork {"count": 16}`` of a quiet sandbox (a file written, no
  process), ``--forks`` rounds, children killed between rounds; each fork's capture is
  new, so no pooled VMM can be waiting for it either.

Every figure carries its sample count; p99 is null below 100 samples (``_common.summary``).
Everything is killed through the API at the end, each server is stopped, and ``leftovers``
must be empty. Output: one JSON object, milliseconds, with the host block. The host has 2
shared cores, the guests run under TCG, and other sessions may run VMs meanwhile: compare
the two modes of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def timed_post(api: httpx.Client, path: str, body: dict[str, Any], status: int
               ) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = api.post(path, json=body, timeout=600)
    ms = (time.perf_counter() - t0) * 1000
    expect_status(r, status)
    return r, ms


def totals(r: httpx.Response) -> dict[str, float]:
    return parse_server_timing(r.headers.get("server-timing", ""), totals=True)


def phases(r: httpx.Response) -> dict[str, float]:
    return parse_server_timing(r.headers.get("server-timing", ""))


class Mode:
    """One server's figures as the rounds go."""

    def __init__(self, name: str, srv: VMServer, api: httpx.Client) -> None:
        self.name, self.srv, self.api = name, srv, api
        self.rows: dict[str, list[float]] = {}
        self.phases: dict[str, list[dict[str, float]]] = {}
        self.hits = 0
        self.resume_sid: str | None = None
        self.fork_src: str | None = None

    def add(self, key: str, value: float) -> None:
        self.rows.setdefault(key, []).append(value)

    def create(self, measured: bool) -> str:
        r, ms = timed_post(self.api, "/v2/sandboxes", {"templateID": "base", "timeout": 600},
                           201)
        sid = str(r.json()["sandboxID"])
        if measured:
            ph, tot = phases(r), totals(r)
            self.add("create", ms)
            self.phases.setdefault("create", []).append(ph)
            if "host" in tot:
                self.add("create_host", tot["host"])
            if "envd_init" in ph:
                self.add("create_guest", ph["envd_init"])
            self.hits += "pool" in ph
            again = init_again(self.srv, sid, r.json().get("envdAccessToken"))
            self.add("init_again", again)
            log(f"{self.name}: create {ms:.0f} ms (host {tot.get('host', -1):.1f}, guest "
                f"{ph.get('envd_init', -1):.0f}{', pooled' if 'pool' in ph else ''}; "
                f"/init again {again:.0f})")
        return sid

    def resume(self, after: float) -> None:
        if self.resume_sid is None:
            self.resume_sid = self.create(False)
        sid = self.resume_sid
        timed_post(self.api, f"/sandboxes/{sid}/pause", {}, 204)
        time.sleep(after)
        r, ms = timed_post(self.api, f"/v2/sandboxes/{sid}/connect", {"timeout": 600}, 201)
        self.add("resume", ms)
        self.phases.setdefault("resume", []).append(phases(r))
        if "host" in totals(r):
            self.add("resume_host", totals(r)["host"])
        log(f"{self.name}: resume {ms:.0f} ms (host {totals(r).get('host', -1):.1f})")

    def fork(self) -> None:
        if self.fork_src is None:
            self.fork_src = self.create(False)
            token = self.api.get(f"/sandboxes/{self.fork_src}").json().get("envdAccessToken")
            _write_file(self.srv, self.fork_src, token)
        r, ms = timed_post(self.api, f"/sandboxes/{self.fork_src}/fork", {"count": 16}, 201)
        results = r.json()
        failed = [x for x in results if "error" in x]
        for x in results:
            if "sandbox" in x:
                self.api.delete(f"/sandboxes/{x['sandbox']['sandboxID']}")
        if failed:
            raise RuntimeError(f"fork children failed: {failed[:3]}")
        self.add("fork16_quiet", ms)
        self.phases.setdefault("fork16", []).append(phases(r))
        log(f"{self.name}: fork16 {ms:.0f} ms")

    def done(self) -> None:
        for sid in (self.resume_sid, self.fork_src):
            if sid is not None:
                self.api.delete(f"/sandboxes/{sid}")
        self.resume_sid = self.fork_src = None
        for s in self.api.get("/snapshots").json():
            self.api.delete(f"/templates/{s['snapshotID']}")

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: summary(v) for k, v in self.rows.items()}
        out.update({f"{k}_phases": phase_summaries(rows) for k, rows in self.phases.items()})
        out["pool_hits"] = self.hits
        return out


def interleaved(modes: list[Mode], args: argparse.Namespace) -> None:
    """The same operation on each server in turn, the order swapped every round, so both
    see the same host conditions (other sessions' VMs come and go)."""
    for m in modes:  # warm-up: cold page cache, the pool's first miss (it learns demand)
        expect_status(m.api.delete(f"/sandboxes/{m.create(False)}"), 204)
    time.sleep(2.0)
    for i in range(args.n):
        for m in modes if i % 2 == 0 else modes[::-1]:
            sid = m.create(True)
            expect_status(m.api.delete(f"/sandboxes/{sid}"), 204)
            time.sleep(args.gap)
    for i in range(args.n):
        for m in modes if i % 2 == 0 else modes[::-1]:
            m.resume(args.resume_after)
            time.sleep(args.gap)
    for m in modes:
        if m.resume_sid is not None:
            m.api.delete(f"/sandboxes/{m.resume_sid}")
            m.resume_sid = None
    for i in range(args.forks):
        for m in modes if i % 2 == 0 else modes[::-1]:
            m.fork()
            time.sleep(1.0)


def init_again(srv: VMServer, sid: str, token: str | None) -> float:
    """A second ``/init`` right after the create's, as the node sends it (to the sandbox's
    host address; the proxy does not pass ``/init``): the same request to the same guest,
    its code now translated (TCG) and its pages touched."""
    import asyncio
    import sqlite3

    from aenv.client.envd import ENVD_PORT, EnvdClient

    db = sqlite3.connect(f"file:{srv.settings.home / 'aenv.db'}?mode=ro", uri=True, timeout=10)
    try:
        (host_ip,) = db.execute("SELECT host_ip FROM sandboxes WHERE id = ?", (sid,)).fetchone()
    finally:
        db.close()

    async def go() -> float:
        envd = EnvdClient(f"http://{host_ip}:{ENVD_PORT}")
        try:
            t0 = time.perf_counter()
            await envd.init(access_token=token, env_vars={}, current_token=token,
                            entropy=os.urandom(64))
            return (time.perf_counter() - t0) * 1000
        finally:
            await envd.aclose()

    return asyncio.run(go())


def _write_file(srv: VMServer, sid: str, token: str | None) -> None:
    import asyncio

    from aenv.client.envd import EnvdClient

    async def go() -> None:
        envd = EnvdClient.through_proxy(srv.url, sid, token)
        try:
            r = await envd.run("echo state > /home/user/state.txt", timeout=30)
            if r.exit_code != 0:
                raise RuntimeError(f"writing the file exited {r.exit_code}: {r.stderr}")
        finally:
            await envd.aclose()

    asyncio.run(go())


def start_server(name: str, pool_size: int, net: int, home: Path) -> VMServer:
    srv = VMServer(home, net, Settings.from_env().artifacts)
    srv.settings = dataclasses.replace(srv.settings,
                                       name_prefix=f"{srv.settings.name_prefix[:5]}{name[:2]}")
    before = os.environ.get("AENV_VMM_POOL_SIZE")
    os.environ["AENV_VMM_POOL_SIZE"] = str(pool_size)  # the server child inherits it
    try:
        log(f"{name}: server with AENV_VMM_POOL_SIZE={pool_size} (home {home})")
        srv.start()
    finally:
        if before is None:
            os.environ.pop("AENV_VMM_POOL_SIZE", None)
        else:
            os.environ["AENV_VMM_POOL_SIZE"] = before
    return srv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="creates and resumes per mode")
    ap.add_argument("--forks", type=int, default=5, help="fork x16 rounds per mode")
    ap.add_argument("--gap", type=float, default=0.5,
                    help="seconds of quiet after each create and resume (both modes)")
    ap.add_argument("--resume-after", type=float, default=1.0,
                    help="seconds between a pause and its resume (both modes)")
    ap.add_argument("--pool-size", type=int, default=4)
    ap.add_argument("--net", type=int, default=107,
                    help="second octet of the servers' host (10.N.0/24) and veth ranges")
    ap.add_argument("--net2", type=int, default=131, help="the same for the second server")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("vmm_pool.py needs root (network namespaces, VMs)")
    result: dict[str, Any] = {"benchmark": "vmm_pool", "n": args.n, "forks": args.forks,
                              "gap_s": args.gap}
    servers: list[VMServer] = []
    modes: list[Mode] = []
    clients: list[httpx.Client] = []
    try:
        for name, size, net in (("off", 0, args.net), ("on", args.pool_size, args.net2)):
            home = Path(tempfile.mkdtemp(prefix=f"aenv-bench-pool-{name}-"))
            servers.append(srv := start_server(name, size, net, home))
            clients.append(api := srv.api())
            modes.append(Mode(name, srv, api))
        interleaved(modes, args)
        for m in modes:
            m.done()
            result[m.name] = {"vmm_pool_size": 0 if m.name == "off" else args.pool_size,
                              **m.figures()}
    except BaseException:
        for srv in servers:
            if srv.log_path.exists():
                log(f"server log tail:\n{srv.log_path.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for api in clients:
            api.close()
        for name, srv in zip(("off", "on"), servers, strict=False):
            result.setdefault(name, {})["leftovers"] = srv.shut_down()
    emit(result)


if __name__ == "__main__":
    main()
