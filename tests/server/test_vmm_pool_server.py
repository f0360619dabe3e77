"""Pre-started VMMs in a real ``aenv server`` (``AENV_VMM_POOL_SIZE``), driven through the REST
API and the E2B SDK: after a first create from base the node keeps VMMs waiting for base's
state, the next create takes one (its ``Server-Timing`` names ``pool`` and reports the
``host`` share); a pooled VMM killed with SIGKILL does not fail the create that would have
taken it; a resume soon after a pause takes a VMM pre-started for the paused sandbox;
pooled VMMs of a snapshot template are discarded once the template is deleted
and its files collected; a clean stop ends every pooled VMM and a ``kill -9`` of the server
leaves them to the next start, which ends them — while sandboxes made from pooled VMMs are
re-attached both times and keep running commands. ``serving`` fails the test if any
namespace, nft table or VMM process is left at the end.

Its own server (prefix ``aenvpp``, addresses 10.131-132.0.0/24), not the session's.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.orchestrator.timing import parse_server_timing
from aenv.runtime.vmm_pool import PREFIX as POOL_PREFIX
from tests.server.conftest import ServerProcess, sdk_pointed_at, serving

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.slow, pytest.mark.timeout(600)]

SERVER_PREFIX = os.environ.get("AENV_TEST_POOL_SERVER_PREFIX", "aenvpp")
SERVER_NET = int(os.environ.get("AENV_TEST_POOL_SERVER_NET", "131"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("pool-server"), SERVER_PREFIX, SERVER_NET)
    server.env["AENV_VMM_POOL_SIZE"] = "2"
    with serving(server), sdk_pointed_at(server):
        yield server


def taken(srv: ServerProcess) -> set[str]:
    """Working directories of live sandboxes (a create from a pooled VMM keeps its
    directory), read from the server's store."""
    db = sqlite3.connect(f"file:{srv.home / 'aenv.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT vm_dir FROM sandboxes WHERE ended_at IS NULL "
                          "AND vm_dir IS NOT NULL").fetchall()
    finally:
        db.close()
    return {Path(r[0]).name for r in rows}


def pooled(srv: ServerProcess) -> dict[int, str]:
    """The live pre-started VMMs of ``srv`` (not those a sandbox took): pid -> the
    snapshot each waits for."""
    out = {}
    sandboxes = taken(srv)
    for d in srv.settings.vms_dir.glob(POOL_PREFIX + "*"):
        if d.name in sandboxes:
            continue
        try:
            pid = int((d / "vmm.pid").read_text())
            restored_from = json.loads((d / "vm.json").read_text())["restored_from"]
            if os.readlink(f"/proc/{pid}/cwd") == str(d.resolve()):
                out[pid] = Path(restored_from).name
        except (OSError, ValueError, KeyError):
            continue
    return out


def waiting(srv: ServerProcess, cond: Callable[[dict[int, str]], bool], what: str,
            timeout: float = 60) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while not cond(now := pooled(srv)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {now}"
        time.sleep(0.2)
    return now


def create(api: httpx.Client, template: str = "base") -> tuple[str, dict[str, float],
                                                                 dict[str, float]]:
    r = api.post("/v2/sandboxes", json={"templateID": template, "timeout": 600})
    assert r.status_code == 201, r.text
    header = r.headers["server-timing"]
    return (r.json()["sandboxID"], parse_server_timing(header),
            parse_server_timing(header, totals=True))


def runs_commands(sid: str, expect: str = "") -> None:
    sbx = Sandbox.connect(sid)
    out = sbx.commands.run("cat /home/user/mark 2>/dev/null; echo ok").stdout
    assert out.endswith("ok\n") and expect in out, out


def test_a_create_takes_a_pooled_vmm_and_reports_the_host_share(srv) -> None:
    with srv.api() as api:
        # Not asserted a miss: the server may have pre-started one of base already, right
        # after snapshotting it at start (seen 70 ms after "ready" on a quiet host).
        first, phases, _ = create(api)
        waiting(srv, lambda p: len(p) >= 1, "a pre-started VMM of base")
        sid, phases, totals = create(api)
        assert "pool" in phases and "vmm" not in phases, phases
        assert totals["host"] == pytest.approx(
            sum(v for k, v in phases.items() if k != "envd_init"), abs=0.01)
        Sandbox.connect(sid).commands.run("echo pooled > /home/user/mark")
        runs_commands(sid, "pooled")
        for s in (first, sid):
            assert api.delete(f"/sandboxes/{s}").status_code == 204


def test_a_pooled_vmm_killed_with_sigkill_does_not_fail_a_create(srv) -> None:
    with srv.api() as api:
        pids = waiting(srv, lambda p: len(p) >= 1, "pre-started VMMs")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        made = []
        for _ in range(len(pids) + 1):
            sid, _, _ = create(api)
            made.append(sid)
            runs_commands(sid)
        for s in made:
            assert api.delete(f"/sandboxes/{s}").status_code == 204


def test_pooled_vmms_of_a_deleted_template_are_discarded(srv) -> None:
    with srv.api() as api:
        base = set(waiting(srv, lambda p: len(p) >= 1, "pre-started VMMs of base").values())
        src, _, _ = create(api)
        r = api.post(f"/sandboxes/{src}/snapshots", json={})
        assert r.status_code == 201, r.text
        snap = r.json()["snapshotID"]
        child, _, _ = create(api, snap)  # asked for once: the pool keeps one of it
        ref = waiting(srv, lambda p: bool(set(p.values()) - base), "a VMM of the snapshot")
        of_snapshot = [pid for pid, s in ref.items() if s not in base]
        for s in (child, src):  # the source's disk reads through the snapshot
            assert api.delete(f"/sandboxes/{s}").status_code == 204
        assert api.delete(f"/templates/{snap}").status_code == 204
        waiting(srv, lambda p: not set(of_snapshot) & set(p), "the snapshot's VMMs to go")
        assert all(s in base for s in pooled(srv).values())


def test_a_resume_soon_after_a_pause_takes_the_vmm_prestarted_for_it(srv) -> None:
    with srv.api() as api:
        base = set(waiting(srv, lambda p: len(p) >= 1, "pre-started VMMs of base").values())
        sid, _, _ = create(api)
        Sandbox.connect(sid).commands.run("echo paused > /home/user/mark")
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        waiting(srv, lambda p: bool(set(p.values()) - base), "a VMM of the paused sandbox")
        r = api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 600})
        assert r.status_code == 201, r.text
        phases = parse_server_timing(r.headers["server-timing"])
        assert "pool" in phases and "vmm" not in phases, phases
        runs_commands(sid, "paused")
        time.sleep(1.5)  # taken once: no VMM of that snapshot is made again
        assert set(pooled(srv).values()) <= base
        assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_restarts_end_pooled_vmms_and_readopt_sandboxes_made_from_them(srv) -> None:
    with srv.api() as api:
        waiting(srv, lambda p: len(p) >= 1, "pre-started VMMs")
        sid, phases, _ = create(api)
        assert "pool" in phases
        Sandbox.connect(sid).commands.run("echo kept > /home/user/mark")
        pids = waiting(srv, lambda p: len(p) >= 1, "the pool refilled")
    # A clean stop: pooled VMMs end with the server; the sandbox's VMM runs on.
    srv.stop()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert not list(srv.settings.vms_dir.glob(POOL_PREFIX + "*")) or not pooled(srv)
    srv.start()
    runs_commands(sid, "kept")
    # A crash: pooled VMMs are left waiting; the next start ends them.
    with srv.api() as api:
        create(api)  # demand again (asks are counted per server run)
        pids = waiting(srv, lambda p: len(p) >= 1, "pre-started VMMs after the restart")
    srv.kill9()
    assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    srv.start()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"pooled VMMs of the crashed server: {pids}"
        time.sleep(0.2)
    runs_commands(sid, "kept")
    with srv.api() as api:
        assert api.delete(f"/sandboxes/{sid}").status_code == 204
