"""``aenv server`` refuses to start — at once, with an error that says why, before it builds
anything — on a bad API key, a home or name prefix another server holds, or a busy port.
(tests/server/test_one_server_per_home_e2e.py has the same against a live server with a
sandbox.)"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.instance_lock import claim_instance
from aenv.network import cleanup_leftovers
from tests.conftest import free_port, run_server_to_end

# Each case starts an ``aenv server`` process (seconds of imports): left out of make test-fast.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="aenv server needs root"),
              pytest.mark.slow]

PREFIX = "aenvst"  # its own name prefix: the prefix lock is host-wide


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    return {**env, "AENV_HOME": str(home), "AENV_NAME_PREFIX": PREFIX, **extra}


def _server(env: dict[str, str], port: int) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``aenv server``; one that starts after all is stopped, VMs and slots included."""
    r, took, stopped = run_server_to_end(env, port, timeout=60)
    if stopped:
        cleanup_leftovers(Settings(home=Path(env["AENV_HOME"]), name_prefix=PREFIX))
        pytest.fail("aenv server did not refuse to start")
    return r, took


def _files(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*"))


def test_a_short_AENV_API_KEY_is_refused_naming_the_variable(tmp_path: Path) -> None:
    r, took = _server(_env(tmp_path / "home", AENV_API_KEY="0123456789"), free_port())
    assert r.returncode == 1, r.stderr[-2000:]
    assert "AENV_API_KEY is 10 characters long; aenv needs at least 32" in r.stderr
    assert "Traceback" not in r.stderr and took < 20
    assert _files(tmp_path / "home") == ["server.lock"]


def test_a_key_file_too_short_is_refused_naming_the_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets/api-key").write_text("hunter2\n")
    r, _ = _server(_env(home), free_port())
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"the API key in {home}/secrets/api-key is 7 characters long" in r.stderr
    assert (home / "secrets/api-key").read_text() == "hunter2\n"
    assert _files(home) == ["secrets", "secrets/api-key", "server.lock"]


def test_a_home_held_by_another_server_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    lock = claim_instance(Settings(home=home, name_prefix="aenvsu"))
    try:
        r, took = _server(_env(home), free_port())
    finally:
        lock.release()
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"another aenv server (pid {os.getpid()}) uses AENV_HOME={home}" in r.stderr
    assert "Traceback" not in r.stderr and took < 20
    assert _files(home) == ["server.lock"]


def test_a_name_prefix_held_by_another_server_is_refused(tmp_path: Path) -> None:
    lock = claim_instance(Settings(home=tmp_path / "other", name_prefix=PREFIX))
    try:
        r, _ = _server(_env(tmp_path / "home"), free_port())
    finally:
        lock.release()
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"another aenv server (pid {os.getpid()}, AENV_HOME={tmp_path / 'other'})" \
        in r.stderr and f"AENV_NAME_PREFIX={PREFIX}" in r.stderr
    assert _files(tmp_path / "home") == ["server.lock"]


def test_a_busy_port_is_refused_before_the_home_is_used(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r, took = _server(_env(tmp_path / "home"), port)
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in r.stderr
    assert "Traceback" not in r.stderr and took < 20
    assert _files(tmp_path / "home") == ["server.lock"]
