"""A template's start command runs after the sandbox's volumes are mounted, so that it
finds them (issue 20).

The node's machines are the real ones; the VM start, the volume server and envd are
stand-ins that record what happened in which order. On a cold boot of a template with a
start command the order is: serve the volumes, envd mounts them, then the start command;
a restored template (its start command has run since its build) runs none; a start
command that fails ends the VM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aenv.config import Settings
from aenv.orchestrator import node as node_module
from aenv.orchestrator.machine import Placement
from aenv.orchestrator.node import NodeMachines, _Running
from aenv.storage.disks import Disk
from aenv.store import SandboxRecord
from aenv.store.records import BuildStatus, TemplateKind, TemplateRecord

MOUNTS = [{"name": "data", "path": "/data", "volumeID": "vol_1"}]


class FakeVM:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def stop(self, timeout: float = 5.0) -> None:
        self.events.append("vm stopped")


class FakeSlot:
    index = 3
    host_ip = "10.11.0.3"
    netns = "aenvtst-ns-3"


class FakeEnvd:
    """``EnvdClient`` as the node uses it; ``fail`` makes the start command fail."""

    fail = False

    def __init__(self, events: list[str], url: str, token: str | None = None) -> None:
        self.events = events

    async def init(self, **kw: Any) -> None:
        mounts = kw.get("volume_mounts") or []
        self.events.append("envd mounts " + ",".join(m["path"] for m in mounts))

    async def start_background(self, cmd: str, **kw: Any) -> None:
        if FakeEnvd.fail:
            raise RuntimeError("start command failed")
        self.events.append(f"start command {cmd}")

    async def run(self, cmd: str, **kw: Any) -> Any:
        self.events.append(f"ready command {cmd}")
        return type("Result", (), {"exit_code": 0})()

    async def aclose(self) -> None:
        pass


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[NodeMachines, list[str], dict[str, bool]]:
    events: list[str] = []
    booted = {"cold": True}
    machines = NodeMachines(Settings(home=tmp_path / "home", name_prefix="aenvtst"))
    machines._release = lambda slot: None  # type: ignore[method-assign]  # no real slot

    async def start_vm(rec: SandboxRecord, template: TemplateRecord) -> Placement:
        events.append("booted" if booted["cold"] else "restored")
        disk = Disk(tmp_path / "rootfs.raw", "raw", "reflink", tmp_path / "base.raw") \
            if booted["cold"] else None
        machines._running[rec.id] = _Running(FakeVM(events), FakeSlot(), disk)  # type: ignore[arg-type]
        return Placement(vm_dir=str(tmp_path / rec.id), vm_pid=1, slot=3,
                         host_ip=FakeSlot.host_ip, runtime="fake")

    monkeypatch.setattr(machines, "_start_vm", start_vm)
    monkeypatch.setattr(node_module.volume_server, "start",
                        lambda settings, netns, ids: events.append("volumes served"))
    monkeypatch.setattr(node_module, "EnvdClient",
                        lambda url, token=None: FakeEnvd(events, url, token))
    FakeEnvd.fail = False
    return machines, events, booted


def sandbox(mounts: list[dict[str, str]] | None = MOUNTS) -> SandboxRecord:
    return SandboxRecord(id="sbx1", template_id="t", state="creating", client_id="c",
                         started_at=0.0, end_at=300.0, cpu_count=1, memory_mb=256,
                         disk_size_mb=1024, envd_token="tok", volume_mounts=mounts)


def template(start_cmd: str | None = "serve /data") -> TemplateRecord:
    return TemplateRecord(id="t", kind=TemplateKind.TEMPLATE, build_id="b",
                          status=BuildStatus.READY, cpu_count=1, memory_mb=256,
                          disk_size_mb=1024, created_at=0.0, updated_at=0.0,
                          start_cmd=start_cmd, ready_cmd="test -d /data")


async def test_a_cold_boots_start_command_runs_after_the_volumes_are_mounted(world) -> None:
    machines, events, _ = world
    await machines.start(sandbox(), template())
    assert events == ["booted", "volumes served", "envd mounts /data",
                      "start command serve /data", "ready command test -d /data"]


async def test_without_volumes_the_start_command_still_runs(world) -> None:
    machines, events, _ = world
    await machines.start(sandbox(mounts=None), template())
    assert events == ["booted", "start command serve /data", "ready command test -d /data"]


async def test_a_restored_template_runs_no_start_command(world) -> None:
    machines, events, booted = world
    booted["cold"] = False
    await machines.start(sandbox(), template())
    assert events == ["restored", "volumes served", "envd mounts /data"]


async def test_a_failed_start_command_ends_the_vm(world) -> None:
    machines, events, _ = world
    FakeEnvd.fail = True
    with pytest.raises(RuntimeError, match="start command failed"):
        await machines.start(sandbox(), template())
    assert events[-1] == "vm stopped"
    assert "sbx1" not in machines._running


async def test_envds_init_of_a_cold_boot_starts_nothing(world) -> None:
    machines, events, _ = world   # the boot's /init: identity only, the command comes later
    await machines._init_envd("http://10.11.0.3:49983", sandbox(), template(), restored=False)
    assert events == ["envd mounts "]
