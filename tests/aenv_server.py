"""An ``aenv`` server (API + proxy + orchestrator) whose sandboxes are envd processes on
the host (see tests/control/process_machines.py), for fast control-plane and CLI tests.

The ``server`` and ``api_env`` fixtures in tests/conftest.py hand out one instance per
test session: every test directory shares it, because the process "VMs" of two servers
would compete for the same loopback addresses.
"""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn

from aenv.config import Settings
from aenv.server import Server, ServerOptions
from aenv.store import TemplateRecord
from tests.conftest import free_port, wait_http
from tests.control.process_machines import ProcessMachines


class RunningServer:
    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        home = tmp_path_factory.mktemp("aenv-home")
        self.machines = ProcessMachines()
        self.server = Server(Settings(home=home), self.machines,
                             ServerOptions(ttl_interval=0.2, metrics_interval=0.5,
                                           host_images=False))
        now = time.time()
        self.server.templates.insert(TemplateRecord(
            id="base", kind="template", build_id="b0", status="ready", cpu_count=2,
            memory_mb=512, disk_size_mb=1024, created_at=now, updated_at=now, names=["base"]))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1",
                                                port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        wait_http(self.url + "/health")

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)
        self.machines.stop_all()
