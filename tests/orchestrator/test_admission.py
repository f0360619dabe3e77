"""Admission control: a create, resume, fork, pause or build that does not fit is refused
before anything is made, with the status and message E2B clients can act on."""

from __future__ import annotations

import dataclasses
import time

import pytest

from aenv.orchestrator.admission import Budget
from aenv.orchestrator.errors import InsufficientStorage, InvalidRequest, LimitReached
from aenv.orchestrator.service import CreateOptions, Limits, Orchestrator
from tests.orchestrator.test_orchestrator import FakeMachines, stores_with_base


@pytest.fixture
def world():
    _, sandboxes, templates = stores_with_base(memory_mb=1024)
    machines = FakeMachines()
    # 2 cores x 4 = 8 vCPUs; 4096 MiB x 1 = 4096 MiB.
    budget = Budget(cpu_overcommit=4, memory_overcommit=1, disk_reserve_mb=100,
                    max_cpu_per_sandbox=2, max_memory_mb_per_sandbox=2048)
    machines.host = dataclasses.replace(machines.host, cpus=2, memory_mb=4096)
    orch = Orchestrator(sandboxes, templates, machines, budget=budget,
                        limits=Limits(max_sandboxes=50, max_starting=50))
    return orch, machines


async def test_a_sandbox_larger_than_the_maxima_is_400(world) -> None:
    orch, m = world
    with pytest.raises(InvalidRequest, match="at most 2 vCPUs"):
        await orch.create(CreateOptions(template="base", cpu_count=3))
    with pytest.raises(InvalidRequest, match="at most 2048 MiB memory"):
        await orch.create(CreateOptions(template="base", memory_mb=4096))
    assert m.started == [] and orch.sandboxes.live() == []


async def test_memory_over_the_budget_is_429_and_makes_nothing(world) -> None:
    orch, m = world
    for _ in range(4):
        await orch.create(CreateOptions(template="base"))  # 4 x 1024 MiB = all of it
    with pytest.raises(LimitReached, match="no room for 1 x 1024 MiB"):
        await orch.create(CreateOptions(template="base"))
    assert len(m.started) == 4 and len(orch.sandboxes.live()) == 4


async def test_vcpus_over_the_budget_is_429(world) -> None:
    orch, _ = world
    for _ in range(4):
        await orch.create(CreateOptions(template="base", cpu_count=2, memory_mb=512))
    with pytest.raises(LimitReached, match="vCPUs: 8 of 8 in use"):
        await orch.create(CreateOptions(template="base", memory_mb=512))


async def test_a_killed_sandbox_gives_its_room_back(world) -> None:
    orch, _ = world
    recs = [await orch.create(CreateOptions(template="base")) for _ in range(4)]
    await orch.kill(recs[0].id)
    await orch.create(CreateOptions(template="base"))


async def test_a_fork_that_does_not_fit_is_429_before_any_child(world) -> None:
    orch, m = world
    src = await orch.create(CreateOptions(template="base"))
    with pytest.raises(LimitReached):
        await orch.fork(src.id, 4)  # 5 x 1024 MiB
    assert m.started == [src.id]
    assert len(await orch.fork(src.id, 3)) == 3  # exactly the room left


async def test_a_resume_needs_room_too(world) -> None:
    orch, _ = world
    paused = await orch.create(CreateOptions(template="base"))
    await orch.pause(paused.id)
    for _ in range(4):
        await orch.create(CreateOptions(template="base"))
    with pytest.raises(LimitReached):
        await orch.connect(paused.id, None)
    assert orch.get(paused.id).state == "paused"


async def test_a_cold_boot_needs_space_for_its_ram_file(world) -> None:
    orch, m = world
    m.host = dataclasses.replace(m.host, ram_file_free_mb=512)
    with pytest.raises(LimitReached, match="no space for guest RAM"):
        await orch.create(CreateOptions(template="base"))  # base has no snapshot: boots


async def test_a_full_data_directory_refuses_creates_and_pauses(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base"))
    m.host = dataclasses.replace(m.host, disk_free_mb=600)  # over the reserve, under RAM
    with pytest.raises(InsufficientStorage, match="not enough space to pause"):
        await orch.pause(rec.id)
    assert orch.get(rec.id).state == "running"
    with pytest.raises(InsufficientStorage):
        await orch.snapshot(rec.id)
    await orch.pause(rec.id, memory=False)  # links the disk: needs no room
    m.host = dataclasses.replace(m.host, disk_free_mb=50)
    with pytest.raises(LimitReached, match="data directory"):
        await orch.create(CreateOptions(template="base"))


async def test_reserved_build_vms_count(world) -> None:
    orch, _ = world
    with orch.admission.reserve(2, 3072), pytest.raises(LimitReached):
        await orch.create(CreateOptions(template="base", memory_mb=1024 + 1))
    await orch.create(CreateOptions(template="base", memory_mb=2048))


async def test_ended_sandboxes_are_forgotten_after_the_retention(world) -> None:
    orch, _ = world
    rec = await orch.create(CreateOptions(template="base"))
    await orch.kill(rec.id)
    assert orch.sandboxes.get(rec.id, live_only=False) is not None
    orch.limits = dataclasses.replace(orch.limits, retention_s=0)
    orch.clock = lambda: time.time() + 1
    await orch.expire_once()
    assert orch.sandboxes.get(rec.id, live_only=False) is None
