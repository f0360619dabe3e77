"""Shared volumes through the gateway, against real Redis and fake nodes (no VMs): nodes
with a shared store say ``shared_volumes`` and publish no volumes; the gateway sends a
volume's calls and content to any live one (the next when one refuses the connection),
creates that mount volumes to the best of them rather than to one node, and pins no
persistent snapshot of their sandboxes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from aenv.cluster.registry import IndexEntry, NodeRecord, Registry
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_gateway import KEY, SECRET, gateway_on, serving
from tests.cluster.test_gateway_volumes import VolumeNode
from tests.conftest import free_port

DB = 4


@dataclass
class SharedNode(VolumeNode):
    """A node with a shared store: its record says so, and it publishes no volumes."""

    running: int = 0

    async def publish(self) -> None:
        assert self.registry is not None
        await self.registry.publish(NodeRecord(self.name, self.url, "t", running=self.running,
                                               max_sandboxes=8, shared_volumes=True), [])


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[
        tuple[Registry, httpx.AsyncClient, SharedNode, SharedNode]]:
    async with serving(SharedNode("a")) as a, serving(SharedNode("b")) as b, \
            gateway_on(redis_server.url(DB), KEY, SECRET) as (reg, client):
        for n in (a, b):
            n.registry = reg
            await n.publish()
        yield reg, client, a, b


async def test_a_shared_volumes_calls_go_to_any_node_that_serves_them(cluster: Any) -> None:
    reg, client, _a, _b = cluster
    r = await client.post("/volumes", json={"name": "data"})
    assert r.status_code == 201, r.text
    assert await reg.volume_node("vol_data") is None      # no node holds it
    served = set()
    for _ in range(12):
        r = await client.get("/volumes/vol_data")
        assert r.status_code == 200
        served.add(r.json()["node"])
    assert served == {"a", "b"}                            # spread, not pinned
    r = await client.put("/volumecontent/vol_data/file?path=/x", content=b"y" * 1000,
                         headers={"Authorization": "Bearer t"})
    assert r.status_code == 200 and r.json()["size"] == 1000
    assert r.json()["auth"] == "Bearer t" and not r.json()["key"]
    assert (await client.delete("/volumes/vol_data")).status_code == 204


async def test_a_node_that_refuses_the_connection_is_passed_over(
        cluster: Any) -> None:
    reg, client, _a, _b = cluster
    dead = f"http://127.0.0.1:{free_port()}"   # alive in Redis, nothing listening
    await reg.publish(NodeRecord("dead", dead, "t", shared_volumes=True), [])
    await reg.leave("b")
    for _ in range(8):
        r = await client.get("/volumes/vol_x")
        assert r.status_code == 200 and r.json()["node"] == "a"
        r = await client.get("/volumecontent/vol_x/file?path=/f",
                             headers={"Authorization": "Bearer t"})
        assert r.status_code == 200 and len(r.content) == 3_000_000
    await reg.leave("a")
    await reg.leave("dead")
    r = await client.get("/volumes/vol_x")
    assert r.status_code == 503 and "shared volumes" in r.json()["message"]
    r = await client.get("/volumecontent/vol_x/dir?path=/",
                         headers={"Authorization": "Bearer t"})
    assert r.status_code == 503 and r.json()["code"] == "unavailable"
    r = await client.post("/v2/sandboxes", json={
        "templateID": "base", "volumeMounts": [{"name": "data", "path": "/d"}]})
    assert r.status_code == 503


async def test_creates_that_mount_shared_volumes_go_to_the_emptier_node(
        cluster: Any) -> None:
    _reg, client, a, b = cluster
    for fuller, emptier in ((a, b), (b, a)):
        fuller.running, emptier.running = 6, 0
        await fuller.publish()
        await emptier.publish()
        r = await client.post("/v2/sandboxes", json={
            "templateID": "base", "volumeMounts": [{"name": "data", "path": "/d"}]})
        assert r.status_code == 201 and r.json()["sandboxID"] == f"{emptier.name}-new"


async def test_a_snapshot_of_a_shared_volume_nodes_sandbox_is_not_pinned(
        cluster: Any) -> None:
    reg, client, a, _b = cluster
    a.mounting.add("s1")
    await reg.publish(NodeRecord("a", a.url, "t", shared_volumes=True),
                      [IndexEntry("s1")])
    r = await client.post("/sandboxes/s1/snapshots", json={})
    assert r.status_code == 201
    assert await reg.volumes_pin("snap-s1") is None
    assert not [p for m, p, _, _ in a.seen if m == "GET"]  # not even asked


async def test_shared_and_node_local_volumes_are_not_mounted_together(
        redis_server: RedisServer) -> None:
    async with serving(SharedNode("a")) as a, serving(VolumeNode("l")) as local, \
            gateway_on(redis_server.url(DB), KEY, SECRET) as (reg, client):
        for n in (a, local):
            n.registry = reg
            await n.publish()
        assert (await client.post("/volumes", json={"name": "s"})).json()["volumeID"]
        assert a.seen and not local.seen           # creates go to shared-volume nodes
        local.volumes["vol_l"] = "l"
        await local.publish()
        r = await client.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": "l", "path": "/l"}, {"name": "s", "path": "/s"}]})
        assert r.status_code == 400 and "shared volumes" in r.json()["message"]
        r = await client.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": "l", "path": "/l"}]})
        assert r.status_code == 201 and r.json()["sandboxID"] == "l-new"
        r = await client.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": "s", "path": "/s"}]})
        assert r.status_code == 201 and r.json()["sandboxID"] == "a-new"

