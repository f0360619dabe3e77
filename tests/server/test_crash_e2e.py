"""``kill -9`` of the server while sandboxes run: after a restart every sandbox is still
known and usable, and killing them afterwards leaves nothing behind. Uses a server of its
own, since it crashes it."""

from __future__ import annotations

import threading
import time

import pytest
from e2b import Sandbox

from .conftest import ServerProcess, leftovers

pytestmark = [pytest.mark.vm, pytest.mark.net]


@pytest.fixture
def crashable(tmp_path, monkeypatch):
    srv = ServerProcess(tmp_path / "home", prefix="aenvsc", net=17)
    srv.start()
    monkeypatch.setenv("E2B_API_KEY", srv.api_key)
    monkeypatch.setenv("E2B_API_URL", srv.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", srv.url)
    try:
        yield srv
    finally:
        if srv.proc is None or srv.proc.poll() is not None:
            srv.start()  # a test that failed between crash and restart: clean up for real
        srv.kill_all_sandboxes()
        srv.stop()
        left = leftovers(srv.settings)
        assert not any(left.values()), left


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


def test_a_crash_during_pause_leaves_the_sandbox_running_or_cleanly_paused(crashable) -> None:
    srv = crashable
    sbx = Sandbox.create("base")
    sbx.files.write("/home/user/keep.txt", "kept")
    # Dirty 200 MiB so the pause takes long enough to be interrupted.
    sbx.commands.run("head -c 200M /dev/urandom > /dev/shm/ballast", timeout=120)
    done = threading.Event()
    pausing = threading.Thread(target=lambda: (_swallow(sbx.pause), done.set()), daemon=True)
    pausing.start()
    time.sleep(0.15)
    finished_before_the_crash = done.is_set()
    srv.kill9()
    assert not finished_before_the_crash, "the pause was too quick to be interrupted"
    pausing.join(30)
    srv.start()

    assert _partials(srv) == []
    info = Sandbox.get_info(sbx.sandbox_id)
    assert info.state.value in ("running", "paused")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/keep.txt") == "kept"
    again.kill()


def test_a_crash_during_fork_keeps_the_source_and_leaks_nothing(crashable) -> None:
    srv = crashable
    src = Sandbox.create("base")
    src.files.write("/home/user/src.txt", "source")
    done = threading.Event()
    forking = threading.Thread(
        target=lambda: (_swallow(lambda: src.fork(count=4)), done.set()), daemon=True)
    forking.start()
    time.sleep(0.3)
    finished_before_the_crash = done.is_set()
    srv.kill9()
    assert not finished_before_the_crash, "the fork was too quick to be interrupted"
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
