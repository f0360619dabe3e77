"""A sandbox killed while a command streams: the SDKs must say the sandbox was killed.

What E2B does (e2b-dev/infra ``packages/shared/pkg/proxy``): when a sandbox goes away its
proxy resets every upstream connection to it, and Go's reverse proxy then aborts the
response it was streaming (a stream reset). aenv speaks HTTP/1.1, where the same signal is
a TCP reset of the client's connection. The SDKs see the reset, probe envd's ``/health``,
get 502 "The sandbox was not found" and raise ``TimeoutException`` / ``TimeoutError`` "...:
The sandbox was killed or reached its end of life while the request was in flight." These
tests are E2B's own ``test_sandbox_killed_during_run.py`` / ``sandboxKilledDuringRun.test.ts``
(with the SDKs installed here, and the Python one also with E2B's checkout and the SDK
version of that checkout, when ``scripts/e2b_suite.py`` has set those up) plus a foreground
variant killed from another thread, with a bound on how long the error takes to arrive and
a check that the server logs the event without a traceback.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2b import AsyncSandbox, Sandbox, TimeoutException

from aenv.config import Settings
from tests.conftest import run_json_script
from tests.jsflow import JS_DIR
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.vm, pytest.mark.net]

KILLED = "sandbox was killed or reached its end of life"
# The command would run 60 s (SDK timeout 120 s); the error must come long before.
PROMPT_S = 20.0


@pytest.fixture(scope="module")
def sdk(module_sdk: ServerProcess) -> ServerProcess:
    """The session's server (its log is read), and the E2B SDK pointed at it."""
    return module_sdk


class ServerLog:
    """What the server logged between ``mark()`` and ``new()``."""

    def __init__(self, server) -> None:
        self.path = server.log_path
        self.start = 0

    def mark(self) -> None:
        self.start = self.path.stat().st_size

    def new(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")


@pytest.fixture
def server_log(sdk) -> ServerLog:
    log = ServerLog(sdk)
    log.mark()
    return log


def _assert_logged_without_traceback(log: ServerLog, sandbox_id: str) -> None:
    text = log.new()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    assert "ASGI callable returned without completing response" not in text, text
    assert any(f"sandbox {sandbox_id}: stopped while streaming /process.Process/" in line
               for line in text.splitlines()), text


def _wait_for_process(sbx: Sandbox, cmd: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(" ".join([p.cmd, *p.args]).endswith(cmd) for p in sbx.commands.list()):
            return
        time.sleep(0.2)
    raise AssertionError(f"{cmd!r} never showed up in commands.list()")


def test_foreground_command_killed_from_another_thread(sdk, server_log) -> None:
    sbx = Sandbox.create("base")
    outcome: dict = {}

    def run() -> None:
        try:
            sbx.commands.run("sleep 60", timeout=120)
            outcome["error"] = None
        except Exception as e:
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    runner = threading.Thread(target=run)
    runner.start()
    _wait_for_process(sbx, "sleep 60")
    time.sleep(1)
    killed_at = time.monotonic()
    assert Sandbox.kill(sbx.sandbox_id) is True
    runner.join(PROMPT_S + 60)
    assert not runner.is_alive(), "commands.run still waiting after the kill"
    err = outcome["error"]
    assert isinstance(err, TimeoutException), repr(err)
    assert KILLED in str(err), str(err)
    assert outcome["at"] - killed_at < PROMPT_S
    _assert_logged_without_traceback(server_log, sbx.sandbox_id)


def test_e2b_kill_sandbox_while_command_is_running(sdk, server_log) -> None:
    """E2B's tests/sync/sandbox_sync/commands/test_sandbox_killed_during_run.py."""
    sbx = Sandbox.create("base")
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    started = time.monotonic()
    with pytest.raises(TimeoutException) as exc_info:
        cmd.wait()
    assert KILLED in str(exc_info.value)
    assert time.monotonic() - started < PROMPT_S
    _assert_logged_without_traceback(server_log, sbx.sandbox_id)


async def test_e2b_async_kill_sandbox_while_command_is_running(sdk, server_log) -> None:
    """E2B's tests/async/sandbox_async/commands/test_sandbox_killed_during_run.py."""
    sbx = await AsyncSandbox.create("base")
    cmd = await sbx.commands.run("sleep 60", background=True)
    await sbx.kill()
    started = time.monotonic()
    with pytest.raises(TimeoutException) as exc_info:
        await cmd.wait()
    assert KILLED in str(exc_info.value)
    assert time.monotonic() - started < PROMPT_S
    _assert_logged_without_traceback(server_log, sbx.sandbox_id)


@pytest.mark.js
def test_js_kill_sandbox_while_command_is_running(sdk, server_log) -> None:
    """E2B's js-sdk tests/sandbox/commands/sandboxKilledDuringRun.test.ts, and the same
    with a foreground command killed through the API while it runs."""
    result = run_json_script(["node", "killed_during_run.mjs"], {
        "E2B_API_KEY": sdk.api_key, "E2B_API_URL": sdk.url, "E2B_SANDBOX_URL": sdk.url,
    }, cwd=JS_DIR, timeout=300)
    for case in ("background", "foreground"):
        got = result[case]
        assert got["name"] == "TimeoutError", got
        assert KILLED in got["message"], got
        assert got["ms"] < PROMPT_S * 1000, got
        _assert_logged_without_traceback(server_log, got["sandboxId"])


def test_e2b_own_test_with_the_sdk_of_e2bs_checkout(sdk, server_log) -> None:
    """E2B's sync and async test files, run from E2B's checkout (``E2B_SRC``) by the venv
    ``scripts/e2b_suite.py`` made for it (SDK 2.45 there). That SDK takes only a reset,
    not a plain close, as the connection dropped."""
    src = os.environ.get("E2B_SRC")
    pytest_bin = Settings.from_env().artifacts / "e2b-suite/venv/bin/pytest"
    if not src or not pytest_bin.exists():
        pytest.skip("needs E2B_SRC and the venv of scripts/e2b_suite.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(E2B_API_KEY=sdk.api_key, E2B_API_URL=sdk.url, E2B_SANDBOX_URL=sdk.url)
    tests = [f"tests/{kind}/sandbox_{kind}/commands/test_sandbox_killed_during_run.py"
             for kind in ("sync", "async")]
    proc = subprocess.run(
        [str(pytest_bin), "-q", "-p", "no:randomly", "-p", "no:cacheprovider", *tests],
        cwd=Path(src) / "packages/python-sdk", env=env, capture_output=True, text=True,
        timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout
    text = server_log.new()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
