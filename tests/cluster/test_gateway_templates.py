"""Templates through the gateway against real Redis and fake nodes (no VMs): a build goes to
one node and its calls follow it, upload links point at the gateway and uploads stream on
to that node, lists merge without repeats, creates prefer nodes that hold the template,
deletes reach every node."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from aenv.cluster.registry import NodeRecord, Registry
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_gateway import gateway_on, serving
from tests.conftest import free_port

KEY = "e2b_" + "t" * 40
SECRET = "s" * 40


@dataclass
class TemplateNode:
    name: str
    build_status: int = 202
    known: set[str] = field(default_factory=set)
    seen: list[tuple[str, str]] = field(default_factory=list)
    uploaded: int = 0
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        self.seen.append((method, path))
        size = 0
        while True:
            msg = await receive()
            size += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        status, body = 200, b"{}"
        parts = path.strip("/").split("/")
        if method == "POST" and path == "/v3/templates":
            status = self.build_status
            if status < 300:
                self.known.add(f"t-{self.name}")
                body = json.dumps({"templateID": f"t-{self.name}", "buildID": "b1",
                                   "aliases": [f"alias-{self.name}"]}).encode()
        elif method == "GET" and path == "/templates":
            body = json.dumps([{"templateID": "shared"}, *[{"templateID": t} for t in
                                                          sorted(self.known)]]).encode()
        elif method == "PUT" and path.endswith("/upload"):
            self.uploaded += size
        elif method == "GET" and len(parts) == 4 and parts[2] == "files":
            status = 201
            body = json.dumps({"present": False, "url": f"{self.url}{path}/upload?token=x"}
                              ).encode()
        elif method in ("GET", "DELETE") and len(parts) == 2 and parts[0] == "templates":
            status = (204 if method == "DELETE" else 200) if parts[1] in self.known else 404
            body = b"" if status == 204 else body
        elif method == "POST" and path == "/sandboxes":
            status, body = 201, json.dumps({"sandboxID": f"s-{self.name}"}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


Cluster = tuple[Registry, httpx.AsyncClient, TemplateNode, TemplateNode]


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[Cluster]:
    async with serving(TemplateNode("a")) as a, serving(TemplateNode("b")) as b, \
            gateway_on(redis_server.url(3), KEY, SECRET, "http://gw.example:8080") \
            as (reg, client):
        for n in (a, b):
            await reg.publish(NodeRecord(n.name, n.url, "t"), [])
        yield reg, client, a, b


async def test_a_build_and_its_calls_go_to_one_node_and_uploads_stream_there(
        cluster: Cluster) -> None:
    reg, client, a, b = cluster
    a.build_status = 429                                   # a is full: b builds it
    r = await client.post("/v3/templates", json={"name": "x"})
    assert r.status_code == 202 and r.json()["templateID"] == "t-b"
    assert await reg.template_home("t-b") == "b" and await reg.template_home("alias-b") == "b"
    a.seen.clear()
    link = await client.get("/templates/t-b/files/h1")
    assert link.status_code == 201
    url = link.json()["url"]
    assert url == "http://gw.example:8080/templates/t-b/files/h1/upload?token=x"
    up = await client.put(url.removeprefix("http://gw.example:8080"),
                          content=b"x" * (3 << 20), headers={"X-API-KEY": ""})
    assert up.status_code == 200 and b.uploaded == 3 << 20   # past the 1 MiB body limit
    assert (await client.post("/v2/templates/t-b/builds/b1", json={})).status_code == 200
    assert (await client.get("/templates/t-b/builds/b1/status")).status_code == 200
    assert [p for _, p in a.seen] == []                    # nothing of it went to a


async def test_lists_merge_creates_prefer_holders_and_deletes_reach_every_node(
        cluster: Cluster) -> None:
    reg, client, a, b = cluster
    a.build_status = 429
    await client.post("/v3/templates", json={"name": "x"})
    b.known.add("t-a")
    a.known.add("t-a")
    listed = (await client.get("/templates")).json()
    assert sorted(t["templateID"] for t in listed) == ["shared", "t-a", "t-b"]
    # a is first by id at equal load; the template's node b is preferred
    r = await client.post("/sandboxes", json={"templateID": "t-b"})
    assert r.json() == {"sandboxID": "s-b"}
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.json() == {"sandboxID": "s-a"}
    assert await reg.template_nodes("base") == set()        # every node has its own base
    assert (await client.delete("/templates/t-a")).status_code == 204
    assert ("DELETE", "/templates/t-a") in a.seen and ("DELETE", "/templates/t-a") in b.seen
    assert (await client.get("/templates/nope")).status_code == 404
    assert (await client.get("/templates/t-a")).status_code == 200   # first that knows it
