"""A cluster node without VMs, in its own process: the real ``aenv.server.Server`` (API,
orchestrator, store, node agent) over ``IdleMachines`` (a sandbox is "running" exactly
while the store says so), served by the ``DrainingServer`` that ``aenv server`` runs, so
SIGTERM drains as on a real node.

``python -m tests.cluster.idle_node HOME PORT REDIS_URL NODE_ID SECRET DRAIN_TIMEOUT``;
``IdleNode`` starts one and stops it (SIGKILL at the end if it is still there).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import ROOT, free_port


def main(home: str, port: str, redis_url: str, node_id: str, secret: str,
         drain_timeout: str) -> None:
    import logging

    import uvicorn

    from aenv.cluster.drain import DrainingServer
    from aenv.config import Settings
    from aenv.server import Server
    from aenv.store import TemplateRecord
    from tests.deploy.test_drain import IdleMachines

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    url = f"http://127.0.0.1:{port}"
    settings = Settings(home=Path(home), listen_port=int(port), cluster=redis_url,
                        node_id=node_id, cluster_secret=secret, advertise_url=url,
                        drain_timeout=float(drain_timeout))
    srv = Server(settings, IdleMachines())
    now = time.time()
    srv.templates.insert(TemplateRecord(
        id="base", kind="template", build_id="b0", status="ready", cpu_count=1,
        memory_mb=256, disk_size_mb=512, created_at=now, updated_at=now, names=["base"]))
    DrainingServer(uvicorn.Config(srv.app, host="127.0.0.1", port=int(port),
                                  log_level="warning", lifespan="on"),
                   srv.drain).run()


class IdleNode:
    def __init__(self, home: Path, redis_url: str, node_id: str, secret: str,
                 drain_timeout: float = 30.0) -> None:
        self.home, self.node_id = home, node_id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        home.mkdir(parents=True, exist_ok=True)
        self.log = home / "node.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.cluster.idle_node", str(home), str(self.port),
                 redis_url, node_id, secret, str(drain_timeout)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 204:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "idle node did not start"
            time.sleep(0.1)

    @property
    def api_key(self) -> str:
        return (self.home / "secrets/api-key").read_text().strip()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


if __name__ == "__main__":
    main(*sys.argv[1:])
