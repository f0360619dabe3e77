"""A restore sends envd's ``/init`` while the VMM loads its state (issue 21 item 2: a fork
child's /init pipelined), when the driver holds the guest's network from ``prestart`` on.

The node's machines are the real ones; the driver, the slot and envd are stand-ins that
record the order of events. What is checked: /init goes out before the state load ends and
the sandbox runs only once both are done; a failed state load cancels the /init and gives
the slot back; a failed /init ends the VM; a driver without the early network restores and
then sends /init, as before.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from aenv.config import Settings
from aenv.orchestrator import node as node_module
from aenv.orchestrator.node import NodeMachines
from aenv.runtime import SnapshotError
from aenv.store import SandboxRecord
from aenv.store.records import BuildStatus, TemplateKind, TemplateRecord


class FakeSlot:
    index = 3
    host_ip = "10.11.0.3"
    netns = "aenvtst-ns-3"


class FakeVM:
    pid = 4242

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.boot_timings: dict[str, float] = {}

    def is_alive(self) -> bool:
        return True

    async def stop(self, timeout: float = 5.0) -> None:
        self.events.append("vm stopped")


class FakePre:
    def is_alive(self) -> bool:
        return True


class FakeRuntime:
    name = "fake"

    def __init__(self, events: list[str], *, early: bool, fail_load: bool = False) -> None:
        self.events = events
        self.nic_open_at_prestart = early
        self.fail_load = fail_load
        self.init_seen = asyncio.Event()

    async def prestart(self, directory: Path, overrides: Any) -> FakePre:
        self.events.append("prestarted")
        return FakePre()

    async def activate(self, pre: FakePre) -> FakeVM:
        # The state load ends only after /init went out (or gives up after a while).
        try:
            await asyncio.wait_for(self.init_seen.wait(), 0.5)
        except TimeoutError:
            self.events.append("no /init during the load")
        if self.fail_load:
            self.events.append("load failed")
            raise SnapshotError("state did not load", vm_id="sbx1")
        self.events.append("running")
        return FakeVM(self.events)

    async def restore(self, directory: Path, overrides: Any) -> FakeVM:
        return await self.activate(await self.prestart(directory, overrides))


class FakeEnvd:
    fail = False
    runtime: FakeRuntime

    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def init(self, **kw: Any) -> None:
        self.events.append("/init sent")
        FakeEnvd.runtime.init_seen.set()
        await asyncio.sleep(0.01)
        if FakeEnvd.fail:
            raise RuntimeError("envd refused /init")
        self.events.append("/init answered")

    async def aclose(self) -> None:
        pass


def sandbox() -> SandboxRecord:
    return SandboxRecord(id="sbx1", template_id="t", state="creating", client_id="c",
                         started_at=0.0, end_at=300.0, cpu_count=1, memory_mb=256,
                         disk_size_mb=1024, envd_token="tok")


def fork_source() -> TemplateRecord:
    return TemplateRecord(id="t", kind=TemplateKind.TEMPLATE, build_id="fork",
                          status=BuildStatus.READY, cpu_count=1, memory_mb=256,
                          disk_size_mb=1024, created_at=0.0, updated_at=0.0)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[NodeMachines, list[str]]:
    events: list[str] = []
    machines = NodeMachines(Settings(home=tmp_path / "home", name_prefix="aenvtst"))
    machines.vmm_pool = None
    machines._release = lambda slot: events.append("slot released")  # type: ignore[method-assign]
    monkeypatch.setattr(machines.pool, "acquire", lambda policy=None: FakeSlot())
    monkeypatch.setattr(node_module, "EnvdClient", lambda url, token=None: FakeEnvd(events))
    FakeEnvd.fail = False
    return machines, events


def use(machines: NodeMachines, runtime: FakeRuntime) -> None:
    machines.runtime = runtime  # type: ignore[assignment]
    FakeEnvd.runtime = runtime


async def test_init_goes_out_while_the_state_loads(world, tmp_path: Path) -> None:
    machines, events = world
    use(machines, FakeRuntime(events, early=True))
    placement = await machines._restore(sandbox(), fork_source(), tmp_path / "snap")
    assert events == ["prestarted", "/init sent", "running", "/init answered"]
    assert "sbx1" in machines._running
    assert list(placement.phases) == ["slot", "restore", "envd_init"]


async def test_a_failed_state_load_cancels_the_init_and_frees_the_slot(world,
                                                                         tmp_path: Path) -> None:
    machines, events = world
    use(machines, FakeRuntime(events, early=True, fail_load=True))
    with pytest.raises(SnapshotError):
        await machines._restore(sandbox(), fork_source(), tmp_path / "snap")
    assert events[:3] == ["prestarted", "/init sent", "load failed"]
    assert "/init answered" not in events
    assert events[-1] == "slot released"
    assert "sbx1" not in machines._running


async def test_a_failed_init_ends_the_vm(world, tmp_path: Path) -> None:
    machines, events = world
    use(machines, FakeRuntime(events, early=True))
    FakeEnvd.fail = True
    with pytest.raises(RuntimeError, match="refused"):
        await machines._restore(sandbox(), fork_source(), tmp_path / "snap")
    assert events[-2:] == ["vm stopped", "slot released"]
    assert "sbx1" not in machines._running


async def test_without_the_early_network_init_follows_the_restore(world,
                                                                  tmp_path: Path) -> None:
    machines, events = world
    use(machines, FakeRuntime(events, early=False))
    await machines._restore(sandbox(), fork_source(), tmp_path / "snap")
    assert events == ["prestarted", "no /init during the load", "running", "/init sent",
                      "/init answered"]
