"""A second ``aenv server`` on the home, the network-name prefix or the port of a running
one exits at once with an error that says which, and touches nothing of the first: its
sandbox still runs commands, its network slots and files stay as they were."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.network import cleanup_leftovers
from tests.conftest import free_port, run_server_to_end

from .conftest import ServerProcess, leftovers, sdk_pointed_at, serving

pytestmark = [pytest.mark.vm, pytest.mark.net]

QUICK_S = 20.0  # a refusal is an import of the CLI and two syscalls, even under load


class First:
    def __init__(self, srv: ServerProcess, sbx: Sandbox) -> None:
        self.srv, self.sbx = srv, sbx

    def state(self) -> dict[str, object]:
        """What a second server must leave alone."""
        s = self.srv.settings
        return {
            "netns": leftovers(s)["netns"],
            "nft": leftovers(s)["nft"],
            "vms": sorted(os.listdir(s.vms_dir)),
            "snapshots": sorted(os.listdir(s.snapshots_dir)) if s.snapshots_dir.is_dir() else [],
            "api-key": (s.secrets_dir / "api-key").read_text(),
        }


def _kill_strays(settings) -> None:
    for pid in leftovers(settings)["vmm processes"]:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    cleanup_leftovers(settings)


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Iterator[First]:
    srv = ServerProcess(tmp_path_factory.mktemp("first") / "home", prefix="aenvsl", net=19)
    with serving(srv, cleanup=_kill_strays), sdk_pointed_at(srv):
        sbx = Sandbox.create("base")
        sbx.files.write("/home/user/mine.txt", "first server's")
        # The pool refills its warm slot in the background: wait until it has.
        deadline = time.monotonic() + 60
        while len(leftovers(srv.settings)["netns"]) < 1 + srv.settings.warm_slots:
            assert time.monotonic() < deadline, leftovers(srv.settings)
            time.sleep(0.2)
        yield First(srv, sbx)


def _second(env: dict[str, str], port: int) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``aenv server`` to its end (killed, with its group, if it serves)."""
    r, took, _ = run_server_to_end(env, port, timeout=120)
    return r, took


def _assert_untouched(first: First, before: dict[str, object]) -> None:
    r = first.sbx.commands.run("cat /home/user/mine.txt")
    assert r.stdout == "first server's"
    assert first.sbx.sandbox_id in {s.sandbox_id for s in Sandbox.list().next_items()}
    assert first.state() == before


@pytest.mark.parametrize("port", ["same", "other"])
def test_a_second_server_on_the_same_home_exits_and_leaves_the_first_alone(
        first: First, port: str) -> None:
    before = first.state()
    p = first.srv.port if port == "same" else free_port()
    r, took = _second(first.srv.env, p)
    assert r.returncode != 0 and took < QUICK_S, (took, r.stderr[-3000:])
    assert f"another aenv server (pid {first.srv.proc.pid}) uses AENV_HOME" in r.stderr, \
        r.stderr[-3000:]
    _assert_untouched(first, before)


def test_a_second_server_on_the_same_port_exits_and_leaves_the_first_alone(
        first: First, tmp_path: Path) -> None:
    before = first.state()
    other = ServerProcess(tmp_path / "home", prefix="aenvsm", net=21)
    try:
        r, took = _second(other.env, first.srv.port)
        assert r.returncode != 0 and took < QUICK_S, (took, r.stderr[-3000:])
        assert f"127.0.0.1:{first.srv.port}" in r.stderr and "in use" in r.stderr, \
            r.stderr[-3000:]
        _assert_untouched(first, before)
        assert not any(leftovers(other.settings).values())
    finally:
        _kill_strays(other.settings)


def test_a_second_server_with_the_same_name_prefix_exits_and_leaves_the_first_alone(
        first: First, tmp_path: Path) -> None:
    before = first.state()
    env = {**first.srv.env, "AENV_HOME": str(tmp_path / "home")}
    r, took = _second(env, free_port())
    assert r.returncode != 0 and took < QUICK_S, (took, r.stderr[-3000:])
    assert f"another aenv server (pid {first.srv.proc.pid}" in r.stderr, r.stderr[-3000:]
    assert "AENV_NAME_PREFIX=aenvsl" in r.stderr, r.stderr[-3000:]
    _assert_untouched(first, before)
