"""A stand-in for VMs in control-plane tests: each "sandbox" is an envd process on the host.

It lets the real SDK exercise the API, proxy and lifecycle in seconds. Each envd listens on
its own loopback address (127.W.H.L:49983, W apart for each pytest-xdist worker), as each VM
has its own host address. It proves nothing about isolation; the VM tests do that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from aenv.client.envd import ENVD_PORT, EnvdClient
from aenv.orchestrator.errors import Unsupported
from aenv.orchestrator.machine import NodeResources, Placement
from aenv.store import SandboxRecord, TemplateRecord
from tests.conftest import ROOT, stop_process

# pytest-xdist's worker number ("gw3" -> 3), so that workers' envds never share an address.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


class ProcessMachines:
    can_pause = False

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self._next = 2
        self.fail_next_start = False

    def image_key(self) -> str | None:
        return None

    def resources(self) -> NodeResources:
        """Host processes: no budget of their own worth weighing."""
        return NodeResources(cpus=1024, memory_mb=1 << 30, disk_free_mb=1 << 30)

    async def prepare(self, keep_slots: set[int], keep_vms: set[str]) -> None:
        pass

    async def close(self) -> None:
        pass

    async def start(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
        if self.fail_next_start:
            self.fail_next_start = False
            raise RuntimeError("injected start failure")
        n = self._next
        self._next += 1
        ip = f"127.{_WORKER}.{n // 256}.{n % 256}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.envd", "--host", ip, "--port", str(ENVD_PORT),
             "--default-user", "user"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[rec.id] = proc
        client = EnvdClient(f"http://{ip}:{ENVD_PORT}")
        try:
            await client.wait_healthy(20, alive=lambda: proc.poll() is None)
            await client.init(access_token=rec.envd_token, env_vars=rec.env_vars)
        except Exception:
            stop_process(proc)
            raise
        finally:
            await client.aclose()
        return Placement(vm_dir="", vm_pid=proc.pid, slot=n, host_ip=ip, runtime="process")

    async def stop(self, rec: SandboxRecord) -> None:
        proc = self.procs.pop(rec.id, None)
        if proc is not None:
            stop_process(proc, grace=2)

    async def commit(self, rec: SandboxRecord, ref: str) -> None:
        """A build ends here: there is no disk to keep, so no layer either."""
        await self.stop(rec)

    async def update_network(self, rec: SandboxRecord) -> None:
        raise Unsupported("host-process sandboxes have no network of their own")

    def is_running(self, rec: SandboxRecord) -> bool:
        proc = self.procs.get(rec.id)
        return proc is not None and proc.poll() is None

    async def reattach(self, rec: SandboxRecord) -> bool:
        proc = self.procs.get(rec.id)
        return proc is not None and proc.poll() is None

    async def pause(self, rec: SandboxRecord, memory: bool, ref: str) -> None:
        raise Unsupported("host-process sandboxes cannot pause")

    async def snapshot(self, rec: SandboxRecord, ref: str) -> None:
        raise Unsupported("host-process sandboxes cannot be snapshotted")

    def has_snapshot(self, ref: str) -> bool:
        return False

    async def collect(self, roots: Callable[[], set[str]]) -> int:
        return 0

    def logs(self, rec: SandboxRecord, start: int | None, limit: int) -> list[dict]:
        return []

    def in_use(self) -> set[int]:
        return set()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, grace=2)
        self.procs.clear()
