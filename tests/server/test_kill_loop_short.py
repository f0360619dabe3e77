"""The kill loop of ``benchmarks/kill_loop.py``, short: five ``kill -9`` of a server of its
own inside a create, resume, snapshot, template build and fork (seed 3), each followed by a
restart on the same home. Paused sandboxes, snapshots and templates that existed must stay
usable, running ones re-attached, every record in a state the API explains, and nothing
may leak (VMMs neither adopted nor stopped, netns, nft tables, files)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.kill_loop import run_kill_loop

from .conftest import ServerProcess, leftovers

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(400)]

KNOWN_LEAKS: tuple[str, ...] = ()  # none known (test_soak_short checks the two once known)


@pytest.fixture(scope="module")
def kill_loop(tmp_path_factory) -> Iterator[dict]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    srv = ServerProcess(tmp_path_factory.mktemp("kill-loop") / "home", prefix="aenvkq", net=57)
    srv.start()
    try:
        yield run_kill_loop(srv, 5, seed=3, calibrate=False, running=1)
    finally:
        if srv.proc is None or srv.proc.poll() is not None:
            srv.start()  # a round failed between its kill and its restart
        srv.kill_all_sandboxes()
        srv.stop()
        left = leftovers(srv.settings)
        if any(left.values()):
            from aenv.network import cleanup_leftovers

            cleanup_leftovers(srv.settings)
        assert not any(left.values()), left


def test_five_kills_mid_operation_leave_everything_usable_and_explained(kill_loop) -> None:
    assert kill_loop["kills"] == 5
    assert set(kill_loop["per_operation"]) == {"create", "resume", "snapshot", "template",
                                               "fork"}
    problems = [p for p in kill_loop["problem_details"] if p["kind"] not in KNOWN_LEAKS]
    assert problems == []


def test_after_five_kills_nothing_is_left_behind(kill_loop) -> None:
    final = {k: v for k, v in kill_loop["final_audit"]["problems"].items()
             if k not in KNOWN_LEAKS}
    assert final == {}
    assert kill_loop["final_audit"]["counts"]["vmm_processes"] == 0
