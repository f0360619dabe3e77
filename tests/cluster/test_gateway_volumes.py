"""Volumes and secrets through the gateway, against real Redis and fake nodes (no VMs):
a volume's calls and the creates that mount it go to the node that holds it, its content
streams there with the volume's token, names are unique in the cluster; secrets are the
cluster's, in Redis, sealed with the key every node derives from the cluster secret."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from aenv.cluster.node_agent import NodeAgent
from aenv.cluster.registry import IndexEntry, NodeRecord, Registry
from aenv.cluster.shared_secrets import SharedSecrets
from aenv.store.secret_box import SecretKeyError
from aenv.store.secrets import SecretsUnavailable
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_gateway import KEY, SECRET, gateway_on, serving
from tests.conftest import free_port

DB = 3


@dataclass
class VolumeNode:
    """Answers like a node for volumes: a create makes ``vol_<name>`` and publishes the
    node's volumes before it answers (as ``PublishAfterChange`` does); content calls echo
    what arrived. Records (method, path, headers, body size) of every request."""

    name: str
    registry: Registry | None = None
    volumes: dict[str, str] = field(default_factory=dict)   # id -> name
    seen: list[tuple[str, str, dict[str, str], int]] = field(default_factory=list)
    create_delay: float = 0.0
    mounting: set[str] = field(default_factory=set)   # its sandboxes that mount volumes
    cut: list[int] = field(default_factory=list)      # bytes of requests cut short
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def publish(self) -> None:
        assert self.registry is not None
        await self.registry.publish(NodeRecord(self.name, self.url, "t"), [],
                                    dict(self.volumes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":   # a cut request: no answer to give
                self.cut.append(len(body))
                return
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        method, path = scope["method"], scope["path"]
        self.seen.append((method, path, headers, len(body)))
        status, out = 200, {"node": self.name, "path": path}
        if method == "POST" and path == "/volumes":
            await asyncio.sleep(self.create_delay)
            name = json.loads(body)["name"]
            self.volumes["vol_" + name] = name
            await self.publish()
            status, out = 201, {"volumeID": "vol_" + name, "name": name, "token": "t-" + name}
        elif method == "DELETE" and path.startswith("/volumes/"):
            self.volumes.pop(path.rsplit("/", 1)[1], None)
            await self.publish()
            status = 204
        elif method == "GET" and path == "/volumes":
            raw = json.dumps([{"volumeID": i, "name": n} for i, n in self.volumes.items()])
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": raw.encode()})
            return
        elif method == "POST" and path.endswith("/snapshots"):
            sid = path.split("/")[2]
            status, out = 201, {"snapshotID": f"snap-{sid}", "names": [f"named-{sid}"]}
        elif method == "GET" and path.startswith("/sandboxes/"):
            sid = path.split("/")[2]
            out = {"sandboxID": sid, "volumeMounts": [{"name": "data", "path": "/data"}]
                   if sid in self.mounting else []}
        elif method == "POST" and path == "/v2/sandboxes":
            status, out = 201, {"sandboxID": f"{self.name}-new"}
        elif path.startswith("/volumecontent/"):
            out.update(auth=headers.get("authorization"), size=len(body),
                       secret="x-aenv-cluster-secret" in headers, key="x-api-key" in headers)
            if method == "GET":  # a file's bytes, streamed back in pieces
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/octet-stream")]})
                for _ in range(3):
                    await send({"type": "http.response.body", "body": b"x" * 1_000_000,
                                "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
        raw = b"" if status == 204 else json.dumps(out).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": raw})


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[
        tuple[Registry, httpx.AsyncClient, VolumeNode, VolumeNode]]:
    async with serving(VolumeNode("a")) as a, serving(VolumeNode("b")) as b, \
            gateway_on(redis_server.url(DB), KEY, SECRET) as (reg, client):
        for n in (a, b):
            n.registry = reg
            await n.publish()
        yield reg, client, a, b


async def test_a_volume_lives_on_one_node_and_its_calls_and_mounts_go_there(
        cluster: Any) -> None:
    reg, client, a, b = cluster
    await reg.publish(NodeRecord("b", b.url, "t", running=3, max_sandboxes=8), [], {})
    r = await client.post("/volumes", json={"name": "data"})
    assert r.status_code == 201 and r.json()["volumeID"] == "vol_data"
    assert [(m, p) for m, p, _, _ in a.seen] == [("POST", "/volumes")]  # a: less full
    assert await reg.volume_node("vol_data") == "a"                     # routed at once
    # names are the cluster's: taken on a is taken everywhere
    r = await client.post("/volumes", json={"name": "data"})
    assert r.status_code == 409 and "already exists" in r.json()["message"]
    assert len(a.seen) + len(b.seen) == 1
    r = await client.get("/volumes/vol_data")
    assert r.json() == {"node": "a", "path": "/volumes/vol_data"}
    assert (await client.get("/volumes/vol_nope")).status_code == 404
    # a create that mounts it goes to a, even when a is the fuller node now
    await reg.publish(NodeRecord("a", a.url, "t", running=7, max_sandboxes=8), [],
                      dict(a.volumes))
    await reg.publish(NodeRecord("b", b.url, "t", running=0, max_sandboxes=8), [], {})
    mounts = {"templateID": "base", "volumeMounts": [{"name": "data", "path": "/data"}]}
    r = await client.post("/v2/sandboxes", json=mounts)
    assert r.status_code == 201 and r.json()["sandboxID"] == "a-new"
    r = await client.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.json()["sandboxID"] == "b-new"                             # no mounts: b
    r = await client.post("/v2/sandboxes", json={
        "templateID": "base", "volumeMounts": [{"name": "nope", "path": "/data"}]})
    assert r.status_code == 400 and r.json()["message"] == "volume 'nope' does not exist"
    b.volumes["vol_other"] = "other"
    await b.publish()
    r = await client.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
        {"name": "data", "path": "/data"}, {"name": "other", "path": "/other"}]})
    assert r.status_code == 400 and "different nodes" in r.json()["message"]
    # its node gone: its calls and its mounts say so, nothing goes elsewhere
    await reg.leave("a")
    assert (await client.get("/volumes/vol_data")).status_code == 503
    r = await client.post("/v2/sandboxes", json=mounts)
    assert r.status_code == 503 and "(a)" in r.json()["message"]
    await a.publish()
    assert (await client.delete("/volumes/vol_data")).status_code == 204
    assert await reg.volume_node("vol_data") is None
    assert await reg.volume_name_node("data") is None


async def test_a_snapshot_of_a_sandbox_with_volumes_makes_sandboxes_on_their_node(
        cluster: Any) -> None:
    reg, client, a, b = cluster
    a.volumes["vol_data"] = "data"
    a.mounting.add("sb1")
    await reg.publish(NodeRecord("a", a.url, "t", running=7, max_sandboxes=8),
                      [IndexEntry("sb1"), IndexEntry("sb2")], dict(a.volumes))
    await reg.publish(NodeRecord("b", b.url, "t", running=0, max_sandboxes=8), [], {})
    r = await client.post("/sandboxes/sb1/snapshots", json={})
    assert r.status_code == 201 and r.json()["snapshotID"] == "snap-sb1"
    assert await reg.volumes_pin("snap-sb1") == "a" and await reg.volumes_pin("named-sb1") == "a"
    assert (await client.post("/sandboxes/sb2/snapshots")).status_code == 201
    assert await reg.volumes_pin("snap-sb2") is None            # sb2 mounts no volume
    for ref in ("snap-sb1", "named-sb1"):                       # a is fuller: still a
        r = await client.post("/v2/sandboxes", json={"templateID": ref})
        assert r.json()["sandboxID"] == "a-new"
    r = await client.post("/v2/sandboxes", json={"templateID": "snap-sb2"})
    assert r.json()["sandboxID"] == "b-new"
    b.volumes["vol_other"] = "other"
    await b.publish()
    r = await client.post("/v2/sandboxes", json={
        "templateID": "snap-sb1", "volumeMounts": [{"name": "other", "path": "/o"}]})
    assert r.status_code == 400 and "different nodes" in r.json()["message"]


async def test_the_list_merges_every_nodes_volumes(cluster: Any) -> None:
    reg, client, _, b = cluster
    assert (await client.post("/volumes", json={"name": "one"})).status_code == 201
    b.volumes["vol_two"] = "two"
    await b.publish()
    r = await client.get("/volumes")
    assert r.status_code == 200
    assert sorted(v["name"] for v in r.json()) == ["one", "two"]
    await reg.leave("b")   # a gone node's volumes are not listed (they are unreachable)
    assert [v["name"] for v in (await client.get("/volumes")).json()] == ["one"]


async def test_two_creates_of_one_name_at_once_make_one_volume(cluster: Any) -> None:
    reg, client, a, b = cluster
    a.create_delay = b.create_delay = 0.3
    first, second = await asyncio.gather(client.post("/volumes", json={"name": "same"}),
                                         client.post("/volumes", json={"name": "same"}))
    assert sorted([first.status_code, second.status_code]) == [201, 409]
    assert len(a.seen) + len(b.seen) == 1
    # the claim is given back: a later create of another name is not held up
    assert (await client.post("/volumes", json={"name": "later"})).status_code == 201
    assert await reg.client.keys("aenv:volume-name:*") == []


async def test_volume_content_streams_to_its_node_with_the_volumes_token(
        cluster: Any) -> None:
    _, client, a, _ = cluster
    assert (await client.post("/volumes", json={"name": "big"})).status_code == 201
    body = b"y" * (3 * 1024 * 1024)   # past the gateway's 1 MiB limit of REST bodies
    r = await client.put("/volumecontent/vol_big/file", params={"path": "/f", "force": "true"},
                         content=body, headers={"X-API-KEY": "", "Authorization": "Bearer t-big"})
    assert r.status_code == 200, r.text
    assert r.json() == {"node": "a", "path": "/volumecontent/vol_big/file", "size": len(body),
                        "auth": "Bearer t-big", "secret": False, "key": False}
    assert a.seen[-1][0] == "PUT"
    async with client.stream("GET", "/volumecontent/vol_big/file", params={"path": "/f"},
                             headers={"Authorization": "Bearer t-big"}) as s:
        got = b"".join([c async for c in s.aiter_bytes()])
    assert got == b"x" * 3_000_000
    r = await client.get("/volumecontent/vol_nope/file", params={"path": "/f"},
                         headers={"Authorization": "Bearer t"})
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"


async def test_an_upload_cut_short_is_cut_short_at_the_node_too(cluster: Any) -> None:
    """A client that goes away mid-upload must not look, to the node, like a whole (short)
    file: the node's request is broken off, never ended."""
    _, client, a, _ = cluster
    assert (await client.post("/volumes", json={"name": "cut"})).status_code == 201
    gw = client._transport.app   # type: ignore[attr-defined]  # the gateway's ASGI app
    messages = [{"type": "http.request", "body": b"z" * 100_000, "more_body": True},
                {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "PUT", "path": "/volumecontent/vol_cut/file",
             "query_string": b"path=%2Ff", "headers": [(b"authorization", b"Bearer t-cut"),
                                                       (b"host", b"gw")],
             "scheme": "http", "server": ("gw", 80), "client": ("127.0.0.1", 1),
             "http_version": "1.1", "root_path": ""}
    await gw(scope, receive, send)
    for _ in range(100):   # the node notices the broken connection
        if a.cut:
            break
        await asyncio.sleep(0.05)
    assert a.cut and a.cut[0] <= 100_000
    assert not [m for _, m, _, n in a.seen if m == "/volumecontent/vol_cut/file"]


async def test_a_node_publishes_its_volumes_and_their_removal(redis_server: RedisServer
                                                              ) -> None:
    reg = Registry.from_url(redis_server.url(DB + 1), ttl_s=30)
    await reg.client.flushdb()
    held = {"vol_1": "one", "vol_2": "two"}
    agent = NodeAgent(Registry.from_url(redis_server.url(DB + 1), ttl_s=30),
                      NodeRecord("n", "http://127.0.0.1:1", "t"), list,
                      volumes=lambda: dict(held))
    try:
        await agent.sync()
        assert [await reg.volume_node(v) for v in ("vol_1", "vol_2")] == ["n", "n"]
        assert await reg.volume_name_node("two") == "n"
        del held["vol_2"]
        await agent.sync(force=False)   # a change of volumes alone is published
        assert await reg.volume_node("vol_2") is None
        assert await reg.volume_name_node("two") is None
        assert await reg.volume_node("vol_1") == "n"
        await reg.forget("n")
        assert await reg.volume_node("vol_1") is None
    finally:
        await agent.close()
        await reg.close()


async def test_secrets_made_through_the_gateway_open_on_every_node(
        cluster: Any, redis_server: RedisServer) -> None:
    reg, client, _, _ = cluster
    r = await client.post("/secrets", json={"name": "API-Key", "value": "v1-s3cret",
                                            "metadata": {"team": "ml"}})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["name"] == "api-key" and made["currentVersion"] == 1
    assert made["secretID"].startswith("sec_") and "value" not in made
    # a node of the cluster (its own client, the same cluster secret) reads the value
    node = SharedSecrets.from_url(redis_server.url(DB), SECRET)
    try:
        assert await node.value("api-key") == "v1-s3cret"
        assert await node.value("API-KEY") == "v1-s3cret"
        assert await node.value("nope") is None
        for ref in ("api-key", made["secretID"]):
            assert (await client.get(f"/secrets/{ref}")).json() == made
        r = await client.post("/secrets/api-key", json={"value": "v2-s3cret"})
        assert r.status_code == 200 and r.json()["currentVersion"] == 2
        assert r.json()["metadata"] == {"team": "ml"}
        assert await node.value("api-key") == "v2-s3cret"   # the next request's value
        assert (await client.post("/secrets", json={"name": "api-key", "value": "x"})
                ).status_code == 409
        assert (await client.post("/secrets", json={"name": "sec_x", "value": "x"})
                ).status_code == 400
        # Redis holds no value in the clear; another cluster's key opens none
        dump = json.dumps([await reg.client.get(k) for k in
                           await reg.client.keys("aenv:secret:*")])
        assert "s3cret" not in dump
        other = SharedSecrets.from_url(redis_server.url(DB), "another-cluster-" + "z" * 30)
        with pytest.raises(SecretKeyError):
            await other.value("api-key")
        await other.close()
        # pages, in creation order, across calls
        for i in range(3):
            await client.post("/secrets", json={"name": f"s{i}", "value": "x"})
        names, token = [], None
        while True:
            r = await client.get("/secrets", params={"limit": 2, **(
                {"nextToken": token} if token else {})})
            names += [s["name"] for s in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                break
        assert names == ["api-key", "s0", "s1", "s2"]
        assert (await client.delete("/secrets/api-key")).status_code == 204
        assert (await client.get("/secrets/api-key")).status_code == 404
        assert await node.value("api-key") is None
        assert (await client.delete("/secrets/api-key")).status_code == 404
        assert (await client.get("/secrets", headers={"X-API-KEY": "e2b_" + "x" * 40})
                ).status_code == 401
    finally:
        await node.close()


async def test_secrets_and_volumes_answer_503_while_redis_is_down(
        redis_server: RedisServer) -> None:
    async with gateway_on(redis_server.url(DB), KEY, SECRET) as (_, client):
        redis_server.stop()
        try:
            r = await client.post("/secrets", json={"name": "k", "value": "v"})
            assert r.status_code == 503 and "Redis" in r.json()["message"]
            r = await client.post("/volumes", json={"name": "v"})
            assert r.status_code == 503 and "Redis" in r.json()["message"]
            r = await client.get("/volumecontent/vol_x/file", params={"path": "/f"},
                                 headers={"Authorization": "Bearer t"})
            assert r.status_code == 503 and r.json()["code"] == "unavailable"
            node = SharedSecrets.from_url(redis_server.url(DB), SECRET)
            try:
                with pytest.raises(SecretsUnavailable):   # egress answers 502 then
                    await node.value("k")
            finally:
                await node.close()
        finally:
            redis_server.start()
