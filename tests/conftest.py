"""Fixtures shared by every test: free ports and child processes that always get cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers with a status below 500."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s: {last}")


def run_json_script(argv: list[str], env: dict[str, str], *, cwd: Path = ROOT,
                    timeout: float = 180) -> dict:
    """Run an SDK client script with ``env`` added; it must exit 0 and print its
    observations as one JSON object on its last line."""
    proc = subprocess.run(argv, cwd=cwd, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{argv[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_server_to_end(env: dict[str, str], port: int, timeout: float
                      ) -> tuple[subprocess.CompletedProcess, float, bool]:
    """Run ``aenv server --port PORT`` (its own process group) until it exits: its result,
    the seconds it took, and whether it was still running after ``timeout`` and had to be
    stopped (SIGTERM to its group, SIGKILL 30 s later; what it wrote is kept)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [PYTHON, "-m", "aenv.cli.main", "server", "--port", str(port)], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    stopped = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    return (subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
            time.monotonic() - t0, stopped)


class Envd:
    """An envd started on the host for a test session."""

    def __init__(self, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(f"/tmp/aenv-test-envd-{self.port}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(self.port), *extra],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_http(self.url + "/health", proc=self.proc)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on a ``server`` fixture are ``slow``: the session's aenv server below (a server
    process with host-process sandboxes, one per xdist worker) or a module's own server
    process (tests/interpreter's, with Jupyter kernels). Each costs seconds of processes
    starting, so ``make test-fast`` leaves them to ``make test``."""
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's aenv server with host-process sandboxes (tests/aenv_server.py),
    shared by every directory; imported lazily so envd-only runs do not load the server."""
    from tests.aenv_server import RunningServer

    s = RunningServer(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture
def api_env(server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The E2B SDK's variables pointed at ``server``."""
    env = {
        "E2B_API_KEY": server.server.api_key,
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_DOMAIN": "localhost",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture(scope="session")
def envd_factory() -> Iterator[type[Envd]]:
    started: list[Envd] = []

    class _Tracked(Envd):
        def __init__(self, *extra: str) -> None:
            super().__init__(*extra)
            started.append(self)

    yield _Tracked
    for e in started:
        e.stop()
