"""Pause/resume, fork and persistent snapshots through the real SDK on microVMs."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from e2b import Sandbox

from aenv.orchestrator.timing import parse_server_timing

pytestmark = [pytest.mark.vm, pytest.mark.net]

# The counter file is replaced atomically, so a reader never sees it half-written.
COUNTER = ("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
           "mv /tmp/counter.new /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 &")


def _files_digest(sbx: Sandbox) -> str:
    return sbx.commands.run("cd /home/user/data && sha256sum * | sha256sum").stdout


def test_twenty_pause_resume_cycles_keep_processes_files_and_clock(sdk) -> None:
    sbx = Sandbox.create("base", timeout=600)
    try:
        sbx.commands.run(COUNTER)
        sbx.commands.run("mkdir -p /home/user/data && for i in 1 2 3 4 5; do "
                         "head -c 65536 /dev/urandom > /home/user/data/f$i; done")
        digest = _files_digest(sbx)
        boot_id = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        last = int(sbx.commands.run("cat /tmp/counter").stdout)
        for cycle in range(20):
            assert sbx.pause()
            assert not sbx.is_running()
            sbx = Sandbox.connect(sbx.sandbox_id)
            now = int(sbx.commands.run("cat /tmp/counter").stdout)
            assert now >= last, f"cycle {cycle}: counter went back from {last} to {now}"
            last = now
            assert _files_digest(sbx) == digest
            guest = float(sbx.commands.run("date +%s.%N").stdout)
            skew = guest - time.time()
            assert abs(skew) < 1.0, f"cycle {cycle}: clock off by {skew:.2f}s"
        time.sleep(0.5)
        assert int(sbx.commands.run("cat /tmp/counter").stdout) > last  # it still counts
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout == boot_id
    finally:
        sbx.kill()


def test_filesystem_pause_keeps_files_but_boots_again(sdk) -> None:
    sbx = Sandbox.create("base")
    try:
        sbx.files.write("/home/user/kept.txt", "on disk")
        # A running snapshot moves the VM onto a new disk overlay: the pause must keep
        # that one, with what was written after the snapshot.
        sbx.create_snapshot()
        sbx.files.write("/home/user/after-snapshot.txt", "newer")
        boot_id = sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        sbx.pause(mode="filesystem")
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert sbx.files.read("/home/user/kept.txt") == "on disk"
        assert sbx.files.read("/home/user/after-snapshot.txt") == "newer"
        assert sbx.commands.run("cat /proc/sys/kernel/random/boot_id").stdout != boot_id
    finally:
        sbx.kill()


@pytest.mark.timeout(300)
def test_fork_sixteen_children_that_share_the_past_but_not_the_future(sdk) -> None:
    """Seventeen guests share two emulated cores here, so each child gets one round trip per
    step and the counter ticks slowly; the loop's process still has to survive the fork."""
    parent = Sandbox.create("base", timeout=600)
    children: list[Sandbox] = []
    try:
        parent.commands.run(COUNTER.replace("sleep 0.1", "sleep 1"))
        parent.files.write("/home/user/uncommitted.txt", "parent state")
        results = parent.fork(count=16)
        children = [c for c in results if isinstance(c, Sandbox)]
        assert len(children) == 16, [r for r in results if not isinstance(r, Sandbox)]
        assert len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 17

        def check(i: int, c: Sandbox) -> tuple[int, str]:
            if c is parent:
                return 0, c.commands.run("cat /home/user/marker 2>/dev/null || echo none").stdout
            assert c.files.read("/home/user/uncommitted.txt") == "parent state"
            c.files.write("/home/user/marker", f"child-{i}")
            counter, marker = c.commands.run(
                "cat /tmp/counter; cat /home/user/marker").stdout.split("\n", 1)
            return int(counter), marker

        # All seventeen run commands at the same time.
        with concurrent.futures.ThreadPoolExecutor(17) as pool:
            seen = list(pool.map(check, range(17), [*children, parent]))
        assert all(n > 0 for n, _ in seen[:16])
        assert [m for _, m in seen] == [f"child-{i}" for i in range(16)] + ["none\n"]
        assert parent.is_running()
    finally:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda c: c.kill(), children))
        parent.kill()


def test_persistent_snapshot_outlives_its_source_and_forks_form_a_tree(sdk) -> None:
    src = Sandbox.create("base")
    made: list[Sandbox] = []
    snaps = []
    try:
        src.files.write("/home/user/level", "0")
        snap = src.create_snapshot()
        snaps.append(snap.snapshot_id)
        assert src.is_running()
        src.kill()
        a, b = Sandbox.create(snap.snapshot_id), Sandbox.create(snap.snapshot_id)
        made += [a, b]
        assert a.files.read("/home/user/level") == b.files.read("/home/user/level") == "0"
        a.files.write("/home/user/level", "a")
        assert b.files.read("/home/user/level") == "0"

        (child,) = a.fork(count=1)
        made.append(child)
        child.files.write("/home/user/level", "child")
        snap2 = child.create_snapshot()
        snaps.append(snap2.snapshot_id)
        from_snap2 = Sandbox.create(snap2.snapshot_id)
        made.append(from_snap2)
        grandkids = from_snap2.fork(count=2)
        made += grandkids
        assert [g.files.read("/home/user/level") for g in grandkids] == ["child", "child"]
        listed = [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert set(snaps) <= set(listed)
    finally:
        for s in made:
            s.kill()
        for sid in snaps:
            Sandbox.delete_snapshot(sid)


def test_snapshot_files_are_freed_once_nothing_depends_on_them(sdk) -> None:
    snapshots_dir = sdk.settings.snapshots_dir

    def on_disk() -> set[str]:
        return {p.name for p in snapshots_dir.iterdir()} if snapshots_dir.is_dir() else set()

    before = on_disk()
    src = Sandbox.create("base")
    snap = src.create_snapshot()
    kept = on_disk() - before
    assert kept
    child = Sandbox.create(snap.snapshot_id)
    src.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id)
    assert on_disk() - before == kept  # the child still runs from it
    assert child.commands.run("echo still").stdout == "still\n"
    child.kill()
    assert on_disk() - before == set()


def test_deleting_a_snapshot_keeps_what_its_running_source_now_writes_on(sdk) -> None:
    """After a running snapshot the source VM's disk is an overlay on the snapshot's file
    and its next capture builds on the snapshot: deleting the snapshot must not delete
    those files while the source runs (its pause would name files that are gone)."""
    src = Sandbox.create("base")
    try:
        src.files.write("/home/user/before", "1")
        snap = src.create_snapshot()
        assert Sandbox.delete_snapshot(snap.snapshot_id)
        src.files.write("/home/user/after", "2")
        assert src.pause()
        src.connect()
        assert src.files.read("/home/user/before") == "1"
        assert src.files.read("/home/user/after") == "2"
    finally:
        src.kill()


def test_ttl_pauses_and_traffic_resumes_when_asked_to(sdk) -> None:
    sbx = Sandbox.create("base", timeout=3,
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/home/user/ttl.txt", "kept over the pause")
        deadline = time.time() + 30
        while Sandbox.get_info(sbx.sandbox_id).state.value != "paused":
            assert time.time() < deadline, "the TTL did not pause the sandbox"
            time.sleep(0.5)
        # Any request to the paused sandbox resumes it (auto-resume on proxy traffic).
        assert sbx.files.read("/home/user/ttl.txt") == "kept over the pause"
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
    finally:
        sbx.kill()


def test_resume_and_fork_answers_say_where_the_time_went(sdk) -> None:
    """``Server-Timing`` on the REST answers: resume phases, and a fork's capture, wall
    time and per-child phase spread."""
    sbx = Sandbox.create("base")
    made = [sbx.sandbox_id]
    try:
        with httpx.Client(base_url=sdk.url, headers={"X-API-KEY": sdk.api_key},
                          timeout=120) as api:
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
            assert r.status_code == 201
            resumed = parse_server_timing(r.headers["server-timing"])
            # the VM continued in place when its pause's memory was still being written
            # (AENV_RESUME_IN_PLACE), else a VMM pre-started after the pause (vmm_pool's
            # want_once) when it was ready in time, else a restore of its own
            assert ({"abandon", "cont", "envd_init"} <= resumed.keys()
                    or {"pool", "state_load", "envd_init"} <= resumed.keys()
                    or {"slot", "prepare", "vmm", "state_load", "envd_init"} <= resumed.keys())
            assert all(v >= 0 for v in resumed.values())
            host = parse_server_timing(r.headers["server-timing"], totals=True)["host"]
            # the host's share: every phase but the guest's (envd_init)
            assert host == pytest.approx(
                sum(v for k, v in resumed.items() if k != "envd_init"), abs=0.01)
            again = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
            assert again.status_code == 200 and "server-timing" not in again.headers

            r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2})
            assert r.status_code == 201
            made += [c["sandbox"]["sandboxID"] for c in r.json()]
            forked = parse_server_timing(r.headers["server-timing"])
            assert {"capture", "children", "vmm_p50", "vmm_max",
                    "envd_init_p50", "envd_init_max"} <= forked.keys()
            assert forked["vmm_p50"] <= forked["vmm_max"] <= forked["children"]
    finally:
        for sid in made:
            Sandbox.kill(sid)
