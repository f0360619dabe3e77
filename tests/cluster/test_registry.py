"""The registry, the node agent and scheduling against a real redis-server (no VMs)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from aenv.cluster.node_agent import NodeAgent
from aenv.cluster.registry import IndexEntry, NodeRecord, Registry, Usage
from aenv.cluster.scheduling import candidates
from tests.cluster.redis_server import RedisServer

_n = itertools.count()


@pytest.fixture
async def registry(redis_server: RedisServer) -> AsyncIterator[Registry]:
    reg = Registry.from_url(redis_server.url(), prefix=f"t{next(_n)}:", ttl_s=0.6)
    try:
        yield reg
    finally:
        await reg.close()


def rec(node_id: str, **kw: object) -> NodeRecord:
    return NodeRecord(node_id=node_id, url=f"http://127.0.0.1:1/{node_id}", version="t",
                      **kw)  # type: ignore[arg-type]


async def test_publish_indexes_every_sandbox_and_replaces_the_nodes_share(
        registry: Registry) -> None:
    await registry.publish(rec("a"), [IndexEntry("s1"), IndexEntry("s2", running=False)])
    await registry.publish(rec("b"), [IndexEntry("s3")])
    assert [await registry.locate(s) for s in ("s1", "s2", "s3", "nope")] == \
        ["a", "a", "b", None]
    # a's sandbox s1 went away, s4 (a fork child) came: only a's share changes
    await registry.publish(rec("a"), [IndexEntry("s2", running=False), IndexEntry("s4")])
    assert await registry.locate("s1") is None
    assert await registry.locate("s4") == "a"
    assert await registry.locate("s3") == "b"
    assert await registry.node_sandboxes("a") == {"s2", "s4"}
    await registry.publish(rec("a"), [])
    assert await registry.node_sandboxes("a") == set()
    assert await registry.locate("s2") is None


async def test_a_node_silent_past_its_ttl_is_unhealthy_and_leave_is_at_once(
        registry: Registry) -> None:
    await registry.publish(rec("a"), [])
    await registry.publish(rec("b"), [])
    assert [(n.record.node_id, n.status) for n in await registry.nodes()] == \
        [("a", "ready"), ("b", "ready")]
    await registry.leave("b")
    assert (await registry.node("b")).status == "unhealthy"  # type: ignore[union-attr]
    assert await registry.heartbeat("a") is True  # it was known
    await asyncio.sleep(0.8)                       # past the TTL without a beat
    assert (await registry.node("a")).status == "unhealthy"  # type: ignore[union-attr]
    assert await registry.heartbeat("a") is False  # vanished: the node must publish again
    assert (await registry.node("a")).status == "ready"  # type: ignore[union-attr]
    assert await registry.node("zz") is None


async def test_scheduling_takes_ready_nodes_with_room_least_full_first(
        registry: Registry) -> None:
    await registry.publish(rec("a", running=3, max_sandboxes=8), [])
    await registry.publish(rec("b", running=1, max_sandboxes=8), [])
    await registry.publish(rec("c", running=0, draining=True), [])
    await registry.publish(rec("d", running=8, max_sandboxes=8), [])   # full
    await registry.publish(rec("e", running=2), [])
    await registry.leave("e")                                          # dead
    order = [n.record.node_id for n in candidates(await registry.nodes())]
    assert order == ["b", "a"]
    # creates in flight count: three on b make a (3) the better one
    order = [n.record.node_id for n in candidates(await registry.nodes(), {"b": 3})]
    assert order == ["a", "b"]
    assert [n.record.node_id for n in candidates(await registry.nodes(), {"a": 5})] == ["b"]


class FakeStore:
    def __init__(self) -> None:
        self.entries: list[IndexEntry] = []

    def __call__(self) -> list[IndexEntry]:
        return list(self.entries)


async def test_the_agent_publishes_on_start_on_change_and_when_redis_comes_back_empty(
        registry: Registry, redis_server: RedisServer) -> None:
    store = FakeStore()
    store.entries = [IndexEntry("s1"), IndexEntry("p1", running=False)]
    agent = NodeAgent(registry, rec("n1", max_sandboxes=8), store)
    await agent.start()
    try:
        assert await registry.locate("s1") == "n1"
        node = await registry.node("n1")
        assert node is not None and node.alive
        assert (node.record.running, node.record.paused) == (1, 1)
        # a change with no request (a TTL kill): the next beat publishes it
        store.entries = [IndexEntry("p1", running=False), IndexEntry("s2")]
        await asyncio.sleep(0.5)
        assert await registry.locate("s1") is None
        assert await registry.locate("s2") == "n1"
        # Redis loses everything: the beat finds its key gone and publishes again
        await registry.client.flushdb()
        await asyncio.sleep(0.5)
        assert await registry.locate("s2") == "n1"
        assert await registry.locate("p1") == "n1"
        # Redis restarted empty (a new process): same, once it answers again
        redis_server.restart_empty()
        deadline = asyncio.get_running_loop().time() + 5
        while await _locate_or_none(registry, "s2") != "n1":
            assert asyncio.get_running_loop().time() < deadline, "not republished"
            await asyncio.sleep(0.1)
    finally:
        await agent.close()
    other = Registry.from_url(redis_server.url(), prefix=registry.prefix)
    try:
        node = await other.node("n1")
        assert node is not None and not node.alive      # close left at once
        assert await other.locate("s2") == "n1"         # its sandboxes are still its own
    finally:
        await other.close()


async def _locate_or_none(registry: Registry, sid: str) -> str | None:
    try:
        return await registry.locate(sid)
    except (aioredis.RedisError, OSError):
        return None


async def test_an_unreachable_redis_fails_no_call_of_the_agent() -> None:
    from tests.conftest import free_port

    reg = Registry.from_url(f"redis://127.0.0.1:{free_port()}/0", ttl_s=0.3, timeout_s=0.2)
    agent = NodeAgent(reg, rec("n1"), FakeStore())
    await agent.start()              # logs, does not raise
    assert await agent.sync() is False
    await asyncio.sleep(0.3)         # a beat or two fail quietly
    await agent.close()


async def test_a_paused_sandbox_taken_over_by_another_node_stays_indexed_there(
        registry: Registry) -> None:
    # a offered its paused s1 with its requirements; b resumed it; a, back, no longer has it
    await registry.publish(rec("a", restores={"driver": "qemu"}),
                           [IndexEntry("s1", running=False, requires='{"driver": "qemu"}')])
    assert await registry.requires("s1") == {"driver": "qemu"}
    assert (await registry.node("a")).record.restores == {"driver": "qemu"}  # type: ignore[union-attr]
    await registry.publish(rec("b"), [IndexEntry("s1")])
    assert await registry.locate("s1") == "b"
    assert await registry.requires("s1") is None       # running: nobody else may take it
    await registry.publish(rec("a"), [])
    assert await registry.locate("s1") == "b"
    assert await registry.node_sandboxes("b") == {"s1"}


async def test_the_agent_publishes_a_change_of_usage_alone(registry: Registry) -> None:
    """A create moving from starting to running changes no index entry (both hold a VM),
    but the node's published usage must follow, or gateways keep counting it starting."""
    store = FakeStore()
    store.entries = [IndexEntry("s1")]
    used = Usage(starting=1, vcpus_used=2, memory_used_mb=512)
    agent = NodeAgent(registry, rec("n1", max_starting=8, vcpus=32, memory_mb=4096), store,
                      lambda: used)
    await agent.start()
    try:
        node = await registry.node("n1")
        assert node is not None and (node.record.starting, node.record.vcpus_used,
                                     node.record.memory_used_mb, node.record.vcpus) == \
            (1, 2, 512, 32)
        used = Usage(starting=0, vcpus_used=2, memory_used_mb=512)
        await asyncio.sleep(0.5)                       # a beat (every TTL/3 = 0.2 s)
        node = await registry.node("n1")
        assert node is not None and node.record.starting == 0
    finally:
        await agent.close()
