"""deploy/bin/aenv-drain (the Kubernetes preStop hook) against a real aenv server: the
real API, orchestrator and store, with a machine layer that starts nothing, so a sandbox
is "running" exactly while the store says so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from aenv.config import Settings
from aenv.orchestrator.machine import Placement
from aenv.server import Server, ServerOptions
from aenv.store import SandboxRecord, TemplateRecord
from tests.conftest import free_port, wait_http
from tests.control.process_machines import ProcessMachines
from tests.deploy.files import DRAIN


class IdleMachines(ProcessMachines):
    """Sandboxes with no VM and no process behind them: start and stop only bookkeep."""

    async def start(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
        return Placement(vm_dir="", vm_pid=0, slot=0, host_ip="", runtime="idle")

    async def stop(self, rec: SandboxRecord) -> None:
        pass

    async def reattach(self, rec: SandboxRecord) -> bool:
        return False


class IdleServer:
    def __init__(self, home: Path) -> None:
        self.server = Server(Settings(home=home), IdleMachines(), ServerOptions())
        now = time.time()
        self.server.templates.insert(TemplateRecord(
            id="base", kind="template", build_id="b0", status="ready", cpu_count=1,
            memory_mb=256, disk_size_mb=512, created_at=now, updated_at=now, names=["base"]))
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=port,
                                                log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        wait_http(self.url + "/health")
        self.http = httpx.Client(base_url=self.url,
                                 headers={"X-API-KEY": self.server.api_key}, timeout=10)

    def create(self) -> str:
        r = self.http.post("/sandboxes", json={"templateID": "base", "timeout": 600})
        assert r.status_code == 201, r.text
        return r.json()["sandboxID"]

    def kill(self, sandbox_id: str) -> None:
        assert self.http.delete(f"/sandboxes/{sandbox_id}").status_code == 204

    def stop(self) -> None:
        self.http.close()
        self.uv.should_exit = True
        self.thread.join(10)


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[IdleServer]:
    s = IdleServer(tmp_path / "home")
    yield s
    s.stop()


def drain(*args: str, key: str | None, home: Path | None = None,
          wait: bool = True) -> subprocess.CompletedProcess[str] | subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AENV_API_KEY", "AENV_HOME")}
    if key is not None:
        env["AENV_API_KEY"] = key
    if home is not None:
        env["AENV_HOME"] = str(home)
    cmd = [sys.executable, str(DRAIN), "--interval", "0.2", *args]
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_drain_returns_at_once_when_nothing_runs(idle: IdleServer):
    r = drain("--url", idle.url, "--timeout", "30", key=idle.server.api_key)
    assert r.returncode == 0 and "no running sandboxes" in r.stdout


def test_drain_gives_up_at_the_deadline_while_a_sandbox_runs(idle: IdleServer):
    idle.create()
    t0 = time.monotonic()
    r = drain("--url", idle.url, "--timeout", "1", key=idle.server.api_key)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 running sandbox(es)" in r.stdout
    assert time.monotonic() - t0 < 10


def test_drain_returns_once_the_last_sandbox_is_killed(idle: IdleServer):
    sid = idle.create()
    proc = drain("--url", idle.url, "--timeout", "60", key=idle.server.api_key, wait=False)
    try:
        time.sleep(1.0)
        assert proc.poll() is None, "drain returned while a sandbox was running"
        idle.kill(sid)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err


def test_drain_reads_the_key_file_in_aenv_home(idle: IdleServer):
    idle.create()
    r = drain("--url", idle.url, "--timeout", "0", key=None, home=idle.server.settings.home)
    assert r.returncode == 1 and "1 running" in r.stdout


def test_drain_refuses_to_guess_when_the_key_is_wrong(idle: IdleServer):
    r = drain("--url", idle.url, "--timeout", "5", key="e2b_wrong")
    assert r.returncode == 2 and "refused the API key" in r.stderr


def test_drain_has_nothing_to_wait_for_without_a_server():
    r = drain("--url", f"http://127.0.0.1:{free_port()}", "--timeout", "5", key="k")
    assert r.returncode == 0 and "no answer" in r.stdout
