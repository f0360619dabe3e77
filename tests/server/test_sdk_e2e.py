"""The unmodified E2B Python SDK against ``aenv server`` with real microVM sandboxes.

Configured only through E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
"""

from __future__ import annotations

import datetime
import time
import uuid

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

pytestmark = [pytest.mark.vm, pytest.mark.net]


@pytest.fixture(scope="module")
def shared(live_server):
    """One sandbox for the tests that only read or write inside it."""
    import os

    os.environ.update({"E2B_API_KEY": live_server.api_key, "E2B_API_URL": live_server.url,
                       "E2B_SANDBOX_URL": live_server.url})
    sbx = Sandbox.create("base", envs={"SANDBOX_WIDE": "yes"}, metadata={"role": "shared"})
    yield sbx
    sbx.kill()


def test_commands_run_as_user_and_root_with_sandbox_env(sdk, shared) -> None:
    assert shared.is_running()
    assert shared.commands.run("whoami").stdout.strip() == "user"
    assert shared.commands.run("whoami", user="root").stdout.strip() == "root"
    assert shared.commands.run("echo $SANDBOX_WIDE $X", envs={"X": "1"}).stdout.strip() == "yes 1"
    assert "169.254.0.21" in shared.commands.run("ip -4 addr show eth0").stdout


def test_files_round_trip(sdk, shared) -> None:
    shared.files.write("/home/user/e2e/a.txt", "alpha")
    assert shared.files.read("/home/user/e2e/a.txt") == "alpha"
    assert [e.name for e in shared.files.list("/home/user/e2e")] == ["a.txt"]
    shared.files.remove("/home/user/e2e")
    assert not shared.files.exists("/home/user/e2e")


def test_get_info_and_timeout(sdk, shared) -> None:
    info = shared.get_info()
    assert info.metadata == {"role": "shared"} and info.state.value == "running"
    shared.set_timeout(600)
    assert shared.get_info().end_at.timestamp() > time.time() + 500


def test_connect_by_id_reuses_the_running_sandbox(sdk, shared) -> None:
    again = Sandbox.connect(shared.sandbox_id)
    assert again.commands.run("echo $SANDBOX_WIDE").stdout.strip() == "yes"


def test_access_token_of_one_sandbox_does_not_open_another(sdk, shared, live_server) -> None:
    other = Sandbox.create("base")
    try:
        r = httpx.post(
            live_server.url + "/filesystem.Filesystem/Stat", json={"path": "/"},
            headers={"E2b-Sandbox-Id": other.sandbox_id, "E2b-Sandbox-Port": "49983",
                     "X-Access-Token": shared._envd_access_token,
                     "Content-Type": "application/json", "Connect-Protocol-Version": "1"})
        assert r.status_code == 401
        assert other.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        other.kill()


def test_list_filters_by_metadata_and_pages(sdk) -> None:
    tag = uuid.uuid4().hex[:8]
    a = Sandbox.create("base", metadata={"suite": tag})
    b = Sandbox.create("base", metadata={"suite": tag})
    try:
        pages = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
        first = pages.next_items()
        assert pages.has_next
        second = pages.next_items()
        assert [first[0].sandbox_id, second[0].sandbox_id] == [b.sandbox_id, a.sandbox_id]
        assert not pages.has_next or pages.next_items() == []
    finally:
        a.kill()
        b.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items() == []


async def test_async_create_and_kill(sdk) -> None:
    sbx = await AsyncSandbox.create("base")
    try:
        r = await sbx.commands.run("echo async")
        assert r.stdout.strip() == "async"
    finally:
        assert await sbx.kill()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id)


def test_ttl_expiry_kills_the_sandbox(sdk) -> None:
    sbx = Sandbox.create("base", timeout=2)
    deadline = time.time() + 30
    while sbx.is_running() and time.time() < deadline:
        time.sleep(0.5)
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_missing_or_wrong_key_is_401(sdk, monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "f" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list().next_items()
    r = httpx.get(sdk.url + "/v2/sandboxes")
    assert r.status_code == 401 and set(r.json()) == {"code", "message"}


@pytest.mark.parametrize(("body", "status"), [
    (b"{not json", 400),
    (b'{"templateID": 5}', 400),
    (b'{"templateID": "base", "timeout": "soon"}', 400),
    (b'{"templateID": "no-such-template"}', 404),
    (b'{"templateID": "base", "metadata": {"k": 1}}', 400),
    (b'{"templateID": "base", "pad": "' + b"x" * (2 << 20) + b'"}', 413),
])
def test_bad_create_requests_get_e2b_errors(sdk, body, status) -> None:
    r = httpx.post(sdk.url + "/v2/sandboxes", content=body, timeout=30,
                   headers={"X-API-KEY": sdk.api_key, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"code", "message"} and r.json()["code"] == status
    assert httpx.get(sdk.url + "/health").status_code == 204


def test_unknown_sandbox_is_404_on_the_api_and_502_on_the_proxy(sdk) -> None:
    with pytest.raises(NotFoundException):
        Sandbox.get_info("doesnotexist00000000")
    r = httpx.get(sdk.url + "/health", headers={"E2b-Sandbox-Id": "doesnotexist00000000",
                                                "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_unknown_template_raises(sdk) -> None:
    with pytest.raises(SandboxException):
        Sandbox.create("no-such-template")


def test_metrics_come_from_the_guest(sdk, shared) -> None:
    deadline = time.time() + 30
    metrics = []
    while not metrics and time.time() < deadline:
        metrics = shared.get_metrics()
        time.sleep(1)
    assert metrics, "no sample within 30 s"
    m = metrics[-1]
    assert m.cpu_count >= 1 and 0 < m.mem_used < m.mem_total and m.disk_total > 0
    assert shared.get_metrics(start=datetime.datetime(2000, 1, 1),
                              end=datetime.datetime(2000, 1, 2)) == []


def test_logs_show_the_guest_console(sdk, shared) -> None:
    shared.commands.run("echo '<1>aenv-log-marker' > /dev/kmsg", user="root")
    deadline = time.time() + 10
    while True:
        r = httpx.get(f"{sdk.url}/sandboxes/{shared.sandbox_id}/logs",
                      headers={"X-API-KEY": sdk.api_key})
        assert r.status_code == 200
        if any("aenv-log-marker" in e["line"] for e in r.json()["logs"]):
            break
        assert time.time() < deadline, r.json()["logs"][-5:]
        time.sleep(0.5)
