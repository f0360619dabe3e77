"""envd's guest launcher, run on the host: imports once, re-forks a killed server at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from tests.conftest import PYTHON, ROOT, free_port, wait_http

LAUNCHER = ROOT / "aenv/guest/files/envd_launcher.py"


@pytest.fixture
def launcher(tmp_path):
    port = free_port()
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PYTHON, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _server_pids(log) -> list[int]:
    return [int(p) for p in re.findall(r"envd-fork \S+ pid=(\d+)", log.read_text())]


def test_killed_server_is_forked_again_and_answers(launcher):
    _proc, url, log = launcher
    (first,) = _server_pids(log)
    os.kill(first, signal.SIGKILL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        pids = _server_pids(log)
        if len(pids) == 2:
            try:
                if httpx.get(url + "/health", timeout=0.5).status_code < 300:
                    break
            except httpx.HTTPError:
                pass
        time.sleep(0.02)
    assert len(_server_pids(log)) == 2 and _server_pids(log)[1] != first
    assert time.monotonic() - t0 < 2.0
    assert "envd-exit" in log.read_text() and "rc=-9" in log.read_text()


def test_sigterm_stops_server_and_launcher(launcher):
    proc, _, log = launcher
    (server,) = _server_pids(log)
    proc.send_signal(signal.SIGTERM)
    proc.wait(10)  # raises TimeoutExpired if the launcher keeps running
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(server, 0)
            time.sleep(0.05)
