"""``kill -9`` of the server while sandboxes run: after a restart every sandbox is still
known and usable, and killing them afterwards leaves nothing behind. Uses a server of its
own, since it crashes it."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from e2b import Sandbox

from .conftest import ServerProcess, crash_tested, leftovers, sdk_pointed_at

pytestmark = [pytest.mark.vm, pytest.mark.net]


@pytest.fixture
def crashable(tmp_path):
    with crash_tested(ServerProcess(tmp_path / "home", prefix="aenvsc", net=17)) as srv, \
            sdk_pointed_at(srv):
        yield srv


def test_running_sandboxes_survive_a_server_crash(crashable) -> None:
    sdk = crashable
    a = Sandbox.create("base", metadata={"crash": "a"})
    b = Sandbox.create("base", metadata={"crash": "b"})
    a.files.write("/home/user/state.txt", "before the crash")
    bg = b.commands.run("sleep 600", background=True)

    sdk.kill9()
    sdk.start()

    listed = {s.sandbox_id for s in Sandbox.list().next_items()}
    assert {a.sandbox_id, b.sandbox_id} <= listed
    a2 = Sandbox.connect(a.sandbox_id)
    assert a2.files.read("/home/user/state.txt") == "before the crash"
    b2 = Sandbox.connect(b.sandbox_id)
    assert bg.pid in [p.pid for p in b2.commands.list()]

    assert a2.kill() and b2.kill()
    assert not leftovers(sdk.settings)["vmm processes"]
    # Released slots are cleaned in the background; the warm slot is all that stays.
    deadline = time.monotonic() + 20
    while len((left := leftovers(sdk.settings))["netns"]) > sdk.settings.warm_slots:
        assert time.monotonic() < deadline, left
        time.sleep(0.2)


def _partials(srv) -> list[str]:
    d = srv.settings.snapshots_dir
    return [p.name for p in d.iterdir() if ".partial-" in p.name] if d.is_dir() else []


def _stored_states(srv) -> dict[str, str]:
    """Every sandbox's state as the server's database holds it (read-only, beside it)."""
    db = sqlite3.connect(f"file:{srv.home / 'aenv.db'}?mode=ro", uri=True, timeout=5)
    try:
        return dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
    finally:
        db.close()


def _crash_when(srv, condition, what: str, timeout: float = 120) -> None:
    """``kill -9`` the server the moment ``condition()`` holds (polled every 2 ms), then
    check it still held: the database and the snapshot directory stop with the server, so
    the crash landed in that phase whatever the host's speed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert srv.proc.poll() is None, srv.log_tail()
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.002)
    srv.kill9()
    assert condition(), f"{what} was over before the crash"


def test_a_crash_during_pause_leaves_the_sandbox_running_or_cleanly_paused(crashable) -> None:
    srv = crashable
    sbx = Sandbox.create("base")
    sbx.files.write("/home/user/keep.txt", "kept")
    # 200 MiB of dirty memory: the capture has plenty to write while the crash lands.
    sbx.commands.run("head -c 200M /dev/urandom > /dev/shm/ballast", timeout=120)
    pausing = threading.Thread(target=lambda: _swallow(sbx.pause), daemon=True)
    pausing.start()
    _crash_when(srv, lambda: _stored_states(srv).get(sbx.sandbox_id) == "pausing"
                and bool(_partials(srv)), "the pause writing its snapshot")
    pausing.join(30)
    srv.start()

    assert _partials(srv) == []
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state.value in ("running", "paused")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/keep.txt") == "kept"
    again.kill()


@pytest.mark.parametrize("phase", ["capture", "children"])
def test_a_crash_during_fork_keeps_the_source_and_leaks_nothing(crashable, phase) -> None:
    """The crash lands while the source is captured (``forking``, a snapshot half written)
    or while the children start from the capture (their records ``creating``)."""
    srv = crashable
    src = Sandbox.create("base")
    src.files.write("/home/user/src.txt", "source")

    def in_phase() -> bool:
        states = _stored_states(srv)
        if phase == "capture":
            return states.get(src.sandbox_id) == "forking" and bool(_partials(srv))
        return any(s == "creating" for sid, s in states.items() if sid != src.sandbox_id)

    forking = threading.Thread(target=lambda: _swallow(lambda: src.fork(count=4)),
                               daemon=True)
    forking.start()
    _crash_when(srv, in_phase, {"capture": "the fork's capture",
                                "children": "the children's start"}[phase])
    forking.join(30)
    srv.start()

    assert _partials(srv) == []
    again = Sandbox.connect(src.sandbox_id)
    assert again.files.read("/home/user/src.txt") == "source"
    for s in Sandbox.list().next_items():
        Sandbox.kill(s.sandbox_id)
    assert not leftovers(srv.settings)["vmm processes"]


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:
        pass
