"""``kill -9`` of the server while sandboxes run: after a restart every sandbox is still
known and usable, and killing them afterwards leaves nothing behind. Uses a server of its
own, since it crashes it."""

from __future__ import annotations

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
        if srv.proc is not None and srv.proc.poll() is None:
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
