"""The lifecycle state machine with a stand-in for the host (unit tests of one module)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from aenv.orchestrator.errors import (
    Conflict,
    InvalidRequest,
    LimitReached,
    SandboxNotFound,
    StartFailed,
    TemplateNotFound,
)
from aenv.orchestrator.machine import NodeResources, Placement
from aenv.orchestrator.service import CreateOptions, Limits, Orchestrator
from aenv.store import Database, SandboxStore, TemplateRecord, TemplateStore


class FakeMachines:
    can_pause = True

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.paused: list[str] = []
        self.resumed: list[str] = []
        self.fail = False
        self.alive: set[str] = set()
        self.snapshots: list[str] = []
        self.gc_roots: list[set[str]] = []
        self.restored: list[tuple[str, str | None]] = []
        self.saved: set[str] = set()
        self.networks: list[tuple] = []
        self.host = NodeResources(cpus=4, memory_mb=8192, disk_free_mb=100_000,
                                  ram_file_free_mb=8192)

    def image_key(self) -> str | None:
        return "key-1"

    def resources(self) -> NodeResources:
        return self.host

    async def prepare(self, keep_slots, keep_vms) -> None:
        pass

    async def close(self) -> None:
        pass

    async def start(self, rec, template) -> Placement:
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("boom")
        if template.image in self.saved:
            self.resumed.append(rec.id)
        self.started.append(rec.id)
        self.alive.add(rec.id)
        self.restored.append((rec.id, template.image))
        return Placement(vm_dir=f"/vms/{rec.id}", vm_pid=100, slot=len(self.started),
                         host_ip="10.11.0.1", runtime="fake", restored_from=template.image)

    async def stop(self, rec) -> None:
        await asyncio.sleep(self.delay)
        self.stopped.append(rec.id)
        self.alive.discard(rec.id)

    async def reattach(self, rec) -> bool:
        return rec.id in self.alive

    async def pause(self, rec, memory, ref) -> None:
        await asyncio.sleep(self.delay)
        self.paused.append(rec.id)
        self.saved.add(ref)
        self.alive.discard(rec.id)

    def has_snapshot(self, ref) -> bool:
        return ref in self.saved

    async def snapshot(self, rec, ref) -> None:
        await asyncio.sleep(self.delay)
        self.snapshots.append(rec.id)
        self.saved.add(ref)

    async def collect(self, roots) -> int:
        self.gc_roots.append(set(roots()))
        return 0

    async def commit(self, rec, ref) -> None:
        pass

    def is_running(self, rec) -> bool:
        return rec.id in self.alive

    async def update_network(self, rec) -> None:
        self.networks.append((rec.id, rec.network, rec.allow_internet))

    def logs(self, rec, start, limit) -> list[dict]:
        return []

    def in_use(self) -> set[int]:
        return set()


def stores_with_base(memory_mb: int = 256) -> tuple[Database, SandboxStore, TemplateStore]:
    """An in-memory database whose template store holds a ready ``base`` (1 vCPU,
    ``memory_mb``, 1 GiB disk): the database, its sandbox store and its template store."""
    db = Database(":memory:")
    sandboxes, templates = SandboxStore(db), TemplateStore(db)
    now = time.time()
    templates.insert(TemplateRecord(id="base", kind="template", build_id="b", status="ready",
                                    cpu_count=1, memory_mb=memory_mb, disk_size_mb=1024,
                                    created_at=now, updated_at=now, names=["base"]))
    return db, sandboxes, templates


@pytest.fixture
def world():
    _, sandboxes, templates = stores_with_base()
    machines = FakeMachines(delay=0.05)
    return Orchestrator(sandboxes, templates, machines, limits=Limits(max_sandboxes=3,
                                                                      max_starting=2)), machines


async def test_create_runs_and_kill_removes(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base", metadata={"a": "b"}))
    assert rec.state == "running" and rec.envd_token and rec.metadata == {"a": "b"}
    await orch.kill(rec.id)
    assert m.stopped == [rec.id]
    with pytest.raises(SandboxNotFound):
        orch.get(rec.id)


async def test_unknown_template_is_not_found(world) -> None:
    orch, _ = world
    with pytest.raises(TemplateNotFound):
        await orch.create(CreateOptions(template="nope"))


async def test_failed_start_leaves_no_live_sandbox(world) -> None:
    orch, m = world
    m.fail = True
    with pytest.raises(StartFailed):
        await orch.create(CreateOptions(template="base"))
    assert orch.sandboxes.live() == []


async def test_idempotency_key_returns_the_same_sandbox(world) -> None:
    orch, m = world
    a = await orch.create(CreateOptions(template="base", idempotency_key="k-1"))
    b = await orch.create(CreateOptions(template="base", idempotency_key="k-1"))
    assert a.id == b.id and len(m.started) == 1


async def test_limits_answer_429(world) -> None:
    orch, _ = world
    for _ in range(3):
        await orch.create(CreateOptions(template="base"))
    with pytest.raises(LimitReached):
        await orch.create(CreateOptions(template="base"))


async def test_concurrent_starts_beyond_the_limit_wait_their_turn(world) -> None:
    orch, m = world
    results = await asyncio.gather(*(orch.create(CreateOptions(template="base"))
                                     for _ in range(3)), return_exceptions=True)
    assert all(r.state == "running" for r in results), results
    assert len(m.started) == 3 and orch.start_queue.active == 0


async def test_a_burst_beyond_the_node_or_the_queue_is_refused_at_once() -> None:
    """The 4th of 4 concurrent creates on a node that holds 3 is refused without waiting
    (it could not run once the queue ahead of it started); so is one beyond a full queue."""
    _, sandboxes, templates = stores_with_base()
    m = FakeMachines(delay=0.2)
    orch = Orchestrator(sandboxes, templates, m, limits=Limits(
        max_sandboxes=3, max_starting=1, start_queue=1))
    t0 = time.monotonic()
    results = await asyncio.gather(*(orch.create(CreateOptions(template="base"))
                                     for _ in range(3)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, LimitReached)]
    assert len(refused) == 1 and "queued" in refused[0].message
    assert refused[0].retry_after >= 1
    orch2 = Orchestrator(*stores_with_base()[1:], FakeMachines(delay=0.2), limits=Limits(
        max_sandboxes=3, max_starting=2, start_queue=8))
    results = await asyncio.gather(*(orch2.create(CreateOptions(template="base"))
                                     for _ in range(4)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, LimitReached)]
    assert len(refused) == 1 and "at most 3 sandboxes" in refused[0].message
    assert time.monotonic() - t0 < 2


async def test_pause_while_a_kill_is_in_flight_finds_the_sandbox_gone(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base"))
    kill = asyncio.create_task(orch.kill(rec.id))
    await asyncio.sleep(0)
    with pytest.raises(SandboxNotFound):
        await orch.pause(rec.id)
    await kill
    assert m.paused == []


async def test_two_connects_to_a_paused_sandbox_resume_it_once(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base"))
    await orch.pause(rec.id)
    assert orch.get(rec.id).state == "paused"
    (_, resumed1), (_, resumed2) = await asyncio.gather(orch.connect(rec.id, 60),
                                                          orch.connect(rec.id, 60))
    assert m.resumed == [rec.id]
    assert sorted([resumed1, resumed2]) == [False, True]
    assert orch.get(rec.id).state == "running"


async def test_pausing_a_paused_sandbox_conflicts(world) -> None:
    orch, _ = world
    rec = await orch.create(CreateOptions(template="base"))
    await orch.pause(rec.id)
    with pytest.raises(Conflict):
        await orch.pause(rec.id)


async def test_ttl_kills_or_pauses(world) -> None:
    orch, _ = world
    kill_me = await orch.create(CreateOptions(template="base", timeout=0))
    pause_me = await orch.create(CreateOptions(template="base", timeout=0, auto_pause=True))
    await orch.expire_once()
    with pytest.raises(SandboxNotFound):
        orch.get(kill_me.id)
    assert orch.get(pause_me.id).state == "paused"


async def test_recovery_reattaches_live_vms_and_reports_the_rest_lost(world) -> None:
    orch, m = world
    alive = await orch.create(CreateOptions(template="base"))
    dead = await orch.create(CreateOptions(template="base"))
    m.alive.discard(dead.id)
    await orch.recover()
    assert orch.get(alive.id).state == "running"
    with pytest.raises(SandboxNotFound):
        orch.get(dead.id)
    assert orch.sandboxes.get(dead.id, live_only=False).state == "lost"


def test_connect_extends_but_never_shortens_the_ttl(world) -> None:
    orch, _ = world

    async def go():
        rec = await orch.create(CreateOptions(template="base", timeout=300))
        await orch.connect(rec.id, 10)
        assert orch.get(rec.id).end_at == pytest.approx(rec.end_at, abs=0.01)
        await orch.connect(rec.id, 600)
        assert orch.get(rec.id).end_at > rec.end_at + 200

    asyncio.run(go())


async def test_fork_restores_count_children_from_one_capture(world) -> None:
    orch, m = world
    orch.limits = Limits(max_sandboxes=10, max_starting=2, max_fork=16)
    src = await orch.create(CreateOptions(template="base", timeout=120, metadata={"k": "v"}))
    children = await orch.fork(src.id, 4)
    assert m.snapshots == [src.id]
    assert all(not isinstance(c, Exception) for c in children)
    ids = {c.id for c in children}
    assert len(ids) == 4 and src.id not in ids
    assert len({c.envd_token for c in children} | {src.envd_token}) == 5
    assert all(c.metadata == {"k": "v"} and c.state == "running" for c in children)
    (capture,) = m.saved
    assert {img for sid, img in m.restored if sid in ids} == {capture}
    again = orch.get(src.id)
    assert again.state == "running" and again.end_at == src.end_at
    assert capture in m.gc_roots[-1]  # the source and children keep the capture alive


async def test_fork_reports_each_child_on_its_own(world) -> None:
    orch, m = world
    orch.limits = Limits(max_sandboxes=10, max_fork=16)
    src = await orch.create(CreateOptions(template="base"))
    real_start = m.start
    calls = 0

    async def flaky(rec, tpl):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("no slot")
        return await real_start(rec, tpl)

    m.start = flaky
    results = await orch.fork(src.id, 3)
    assert sum(isinstance(r, StartFailed) for r in results) == 1
    assert sum(not isinstance(r, Exception) for r in results) == 2


async def test_fork_timings_cover_the_capture_and_the_children_that_started(world) -> None:
    orch, m = world
    orch.limits = Limits(max_sandboxes=10, max_fork=16)
    src = await orch.create(CreateOptions(template="base"))
    real_start = m.start
    restores = iter([0.3, None, 0.1, 0.2])  # the second child fails

    async def timed(rec, tpl):
        seconds = next(restores)
        if seconds is None:
            raise RuntimeError("no slot")
        placed = await real_start(rec, tpl)
        return dataclasses.replace(placed, phases={"restore": seconds,
                                                   "envd_init": 2 * seconds})

    m.start = timed
    timings: dict[str, float] = {}
    await orch.fork(src.id, 4, timings=timings)
    assert timings["capture"] >= 0 and timings["children"] >= 0
    assert timings["restore_p50"] == 0.2 and timings["restore_max"] == 0.3
    assert timings["envd_init_p50"] == 0.4 and timings["envd_init_max"] == 0.6


async def test_fork_count_is_bounded_and_needs_a_running_source(world) -> None:
    orch, _ = world
    src = await orch.create(CreateOptions(template="base"))
    with pytest.raises(InvalidRequest):
        await orch.fork(src.id, 17)
    await orch.pause(src.id)
    with pytest.raises(Conflict):
        await orch.fork(src.id, 1)


async def test_snapshot_is_a_template_that_outlives_its_source(world) -> None:
    orch, m = world
    src = await orch.create(CreateOptions(template="base", env_vars={"A": "1"}))
    snap = await orch.snapshot(src.id, "my-snap")
    assert snap.kind == "snapshot" and "my-snap" in snap.names and snap.image
    assert orch.get(src.id).state == "running"
    await orch.kill(src.id)
    assert snap.image in m.gc_roots[-1]
    child = await orch.create(CreateOptions(template="my-snap"))
    assert child.env_vars["A"] == "1"
    orch.delete_template(snap.id)
    await orch.collect_garbage()
    assert snap.image in m.gc_roots[-1]  # the child still runs from it
    await orch.kill(child.id)
    assert snap.image not in m.gc_roots[-1]


async def test_an_interrupted_pause_with_a_complete_snapshot_recovers_as_paused(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base"))
    orch.sandboxes.transition(rec.id, ["running"], "pausing", snapshot_id="snapshot:x")
    m.saved.add("snapshot:x")
    await orch.recover()
    assert orch.get(rec.id).state == "paused"


async def test_an_interrupted_pause_without_a_snapshot_goes_back_to_running(world) -> None:
    orch, _ = world
    rec = await orch.create(CreateOptions(template="base"))
    orch.sandboxes.transition(rec.id, ["running"], "pausing", snapshot_id="snapshot:half")
    await orch.recover()
    got = orch.get(rec.id)
    assert got.state == "running" and got.snapshot_id is None


async def test_a_template_is_snapshotted_once_per_image_key(world) -> None:
    orch, m = world
    await orch.snapshot_template("base", "key-1")
    tpl = orch.templates.get("base")
    assert tpl.image in m.saved and tpl.envd_token
    await orch.snapshot_template("base", "key-1")
    assert len(m.paused) == 1
    await orch.snapshot_template("base", "key-2")
    assert len(m.paused) == 2
    child = await orch.create(CreateOptions(template="base"))
    assert child.restored_from == orch.templates.get("base").image


async def test_connect_during_a_pause_waits_for_it_then_resumes(world) -> None:
    """The proxy's auto-resume relies on this: the API shows "pausing" as paused."""
    orch, m = world
    rec = await orch.create(CreateOptions(template="base"))
    pausing = asyncio.create_task(orch.pause(rec.id))
    while orch.get(rec.id).state != "pausing":
        await asyncio.sleep(0.001)
    got, resumed = await orch.connect(rec.id, None)
    await pausing
    assert resumed and got.state == "running" and m.paused == [rec.id]


async def test_an_image_being_restored_stays_a_root_when_its_template_is_deleted(world) -> None:
    orch, m = world
    src = await orch.create(CreateOptions(template="base"))
    snap = await orch.snapshot(src.id, "short-lived")
    await orch.kill(src.id)
    original = m.start

    async def start(rec, template):
        # Deleted and collected while the create restores from its image.
        orch.delete_template(snap.id)
        await orch.collect_garbage()
        return await original(rec, template)

    m.start = start
    await orch.create(CreateOptions(template="short-lived"))
    assert snap.image in m.gc_roots[-1], "collected while a create was restoring from it"


async def test_update_network_replaces_egress_but_keeps_create_only_options(world) -> None:
    orch, m = world
    rec = await orch.create(CreateOptions(template="base", network={
        "allowPublicTraffic": False, "denyOut": ["1.1.1.1/32"]}, allow_internet=False))
    await orch.update_network(rec.id, {"allowOut": ["8.8.8.8/32"]}, None)
    cur = orch.get(rec.id)
    assert cur.network == {"allowPublicTraffic": False, "allowOut": ["8.8.8.8/32"]}
    assert cur.allow_internet is None
    assert m.networks[-1] == (rec.id, cur.network, None)  # applied to the VM too
    await orch.pause(rec.id)
    with pytest.raises(Conflict):
        await orch.update_network(rec.id, {}, None)


async def test_a_taken_snapshot_name_is_refused_before_the_capture(world) -> None:
    orch, m = world
    src = await orch.create(CreateOptions(template="base"))
    await orch.snapshot(src.id, "taken")
    with pytest.raises(Conflict, match="taken"):
        await orch.snapshot(src.id, "taken")
    assert m.snapshots == [src.id]  # one capture, not two
