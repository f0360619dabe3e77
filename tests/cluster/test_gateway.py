"""The gateway against real Redis and fake nodes (small HTTP servers on loopback, no VMs):
auth, the cluster secret, create failover, merged lists, routing by the index, /nodes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from aenv.api.listing import decode_cursor
from aenv.cluster.gateway import Gateway
from aenv.cluster.registry import IndexEntry, NodeRecord, Registry
from tests.cluster.redis_server import RedisServer
from tests.conftest import free_port

KEY = "e2b_" + "k" * 40
SECRET = "s" * 40


@dataclass
class FakeNode:
    """Answers like a node: creates with ``create_status``, lists its ``sandboxes``, echoes
    sandbox traffic; records every request's (method, path, headers)."""

    name: str
    create_status: int = 201
    sandboxes: list[dict[str, Any]] = field(default_factory=list)
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    gone: set[str] = field(default_factory=set)   # sandboxes whose traffic answers 502

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._echo(scope, receive, send)
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["method"], scope["path"], headers))
        status, body = 200, b"{}"
        extra: list[tuple[bytes, bytes]] = []
        if headers.get("e2b-sandbox-id") in self.gone:  # as a node's proxy answers
            status, body = 502, b'{"code": 502, "message": "The sandbox was not found"}'
        elif "e2b-sandbox-id" in headers and "x-aenv-cluster-secret" not in headers:
            body = json.dumps({"node": self.name, "path": scope["path"],
                               "sandbox": headers["e2b-sandbox-id"],
                               "port": headers["e2b-sandbox-port"]}).encode()
        elif scope["method"] == "POST" and scope["path"] == "/sandboxes":
            status = self.create_status
            body = json.dumps({"sandboxID": f"{self.name}-new"}).encode()
        elif scope["path"] == "/v2/sandboxes":
            page, token = self._page(dict(parse_qsl(scope["query_string"].decode())))
            body = json.dumps(page).encode()
            extra = [(b"x-next-token", token.encode())] if token else []
        elif scope["path"].startswith("/sandboxes/"):
            body = json.dumps({"node": self.name, "path": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *extra]})
        await send({"type": "http.response.body", "body": body})

    def _page(self, q: dict[str, str]) -> tuple[list[dict[str, Any]], str | None]:
        """A page as a node makes it (aenv.api.listing): ordered by (start, id), after the
        cursor, ``limit`` long, a cursor when more follow."""
        def key(s: dict[str, Any]) -> tuple[float, str]:
            started = datetime.fromisoformat(s["startedAt"].replace("Z", "+00:00"))
            return started.timestamp(), s["sandboxID"]

        desc = q.get("order", "desc") == "desc"
        rows = sorted(self.sandboxes, key=key, reverse=desc)
        if "nextToken" in q:
            after = decode_cursor(q["nextToken"])
            rows = [r for r in rows if (key(r) < after if desc else key(r) > after)]
        limit = int(q.get("limit", "100"))
        if len(rows) <= limit:
            return rows, None
        last = key(rows[limit - 1])
        return rows[:limit], base64.urlsafe_b64encode(json.dumps(list(last)).encode()).decode()


    async def _echo(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket that says where it is, then echoes every message."""
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": json.dumps(
            {"node": self.name, "sandbox": headers.get("e2b-sandbox-id"),
             "port": headers.get("e2b-sandbox-port"), "path": scope["path"]})})
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                return
            await send({"type": "websocket.send", "text": msg.get("text"),
                        "bytes": msg.get("bytes")})


@contextlib.asynccontextmanager
async def serving(node: Any) -> AsyncIterator[FakeNode]:
    server = uvicorn.Server(uvicorn.Config(node, host="127.0.0.1", port=node.port,
                                           log_level="warning", lifespan="off",
                                           ws="websockets-sansio"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield node
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def gateway_on(redis_url: str, key: str, secret: str, base_url: str = "http://gw"
                     ) -> AsyncIterator[tuple[Registry, httpx.AsyncClient]]:
    """A flushed Redis DB's registry, and a client (sending ``key``) of an in-process
    gateway over it; the client, the gateway and the registry are closed at the end."""
    reg = Registry.from_url(redis_url, ttl_s=30)
    await reg.client.flushdb()
    gw = Gateway(Registry.from_url(redis_url), api_key=key, cluster_secret=secret)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(gw.app), base_url=base_url,
                               headers={"X-API-KEY": key})
    try:
        yield reg, client
    finally:
        await client.aclose()
        await gw.close()
        await reg.close()


@pytest.fixture
async def cluster(redis_server: RedisServer) -> AsyncIterator[
        tuple[Registry, httpx.AsyncClient, FakeNode, FakeNode]]:
    async with serving(FakeNode("a")) as a, serving(FakeNode("b")) as b, \
            gateway_on(redis_server.url(1), KEY, SECRET) as (reg, client):
        for n in (a, b):
            await reg.publish(NodeRecord(n.name, n.url, "t"), [])
        yield reg, client, a, b


async def test_clients_need_the_gateways_key_and_nodes_get_the_secret_instead(cluster) -> None:
    reg, client, a, _ = cluster
    await reg.publish(NodeRecord("a", a.url, "t"), [IndexEntry("sb1")])
    assert (await client.get("/sandboxes/sb1", headers={"X-API-KEY": "e2b_" + "x" * 40})
            ).status_code == 401
    r = await client.get("/sandboxes/sb1", headers={"X-Aenv-Cluster-Secret": "forged" * 8})
    assert r.status_code == 200 and r.json() == {"node": "a", "path": "/sandboxes/sb1"}
    _, _, headers = a.seen[-1]
    assert headers["x-aenv-cluster-secret"] == SECRET   # the client's value was replaced
    assert "x-api-key" not in headers                   # the client's key stays here
    assert (await client.get("/sandboxes/nope")).status_code == 404


async def test_a_create_refused_by_one_node_goes_to_the_next(cluster) -> None:
    reg, client, a, b = cluster
    await reg.publish(NodeRecord("a", a.url, "t", running=0), [])
    await reg.publish(NodeRecord("b", b.url, "t", running=5), [])
    a.create_status = 503
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201 and r.json()["sandboxID"] == "b-new"
    assert [p for m, p, _ in a.seen] == ["/sandboxes"]  # a was asked first (fewer)
    a.create_status = 429
    b.create_status = 500
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 500                         # every node refused: the last answer
    await reg.leave("a")
    await reg.leave("b")
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 503


async def test_a_create_queues_on_a_node_whose_starts_are_taken_before_a_429(cluster) -> None:
    reg, client, a, b = cluster
    # a: every start taken, a queue place left; b: starts taken and its queue full
    await reg.publish(NodeRecord("a", a.url, "t", max_starting=2, start_queue=2, starting=2,
                                 queued=1), [])
    await reg.publish(NodeRecord("b", b.url, "t", max_starting=2, start_queue=2, starting=2,
                                 queued=2), [])
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201 and r.json()["sandboxID"] == "a-new"
    assert [p for m, p, _ in b.seen] == []              # b could not even queue it
    # a's queue full too: the gateway answers 429 itself, with Retry-After, asking no node
    await reg.publish(NodeRecord("a", a.url, "t", max_starting=2, start_queue=2, starting=2,
                                 queued=2), [])
    seen = len(a.seen)
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["code"] == 429 and len(a.seen) == seen
    await reg.leave("a")
    await reg.leave("b")
    r = await client.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 503


def started(second: int) -> str:
    return f"2026-01-01T00:00:{second:02d}.123456Z"


async def test_lists_merge_every_live_nodes_answer_and_page_across_nodes(cluster) -> None:
    reg, client, a, b = cluster
    a.sandboxes = [{"sandboxID": f"a{i}", "startedAt": started(i)} for i in (1, 3, 5)]
    b.sandboxes = [{"sandboxID": f"b{i}", "startedAt": started(i)} for i in (2, 4)]
    r = await client.get("/v2/sandboxes")
    assert [s["sandboxID"] for s in r.json()] == ["a5", "b4", "a3", "b2", "a1"]
    assert "x-next-token" not in r.headers
    for order, pages in (("desc", [["a5", "b4"], ["a3", "b2"], ["a1"]]),
                         ("asc", [["a1", "b2"], ["a3", "b4"], ["a5"]])):
        seen, token = [], None
        while True:
            params = {"order": order, "limit": "2", **({"nextToken": token} if token else {})}
            r = await client.get("/v2/sandboxes", params=params)
            assert r.status_code == 200, r.text
            seen.append([s["sandboxID"] for s in r.json()])
            token = r.headers.get("x-next-token")
            if token is None:
                break
        assert seen == pages, order
    r = await client.get("/v2/sandboxes", params={"nextToken": "garbage"})
    assert r.status_code == 400
    await reg.publish(NodeRecord("c", f"http://127.0.0.1:{free_port()}", "t"), [])  # dead port
    r = await client.get("/v2/sandboxes")
    assert len(r.json()) == 5 and r.headers["x-aenv-unreachable-nodes"] == "c"


async def test_sandbox_traffic_goes_to_the_sandboxs_node_by_header_or_host(
        cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    reg, client, a, b = cluster
    await reg.publish(NodeRecord("b", b.url, "t"), [IndexEntry("sb2")])
    plain = httpx.AsyncClient(transport=client._transport, base_url="http://gw")
    async with plain:
        r = await plain.get("/health", headers={"E2b-Sandbox-Id": "sb2",
                                                "E2b-Sandbox-Port": "49983"})
        assert r.json() == {"node": "b", "path": "/health", "sandbox": "sb2", "port": "49983"}
        r = await plain.get("/x", headers={"Host": "8080-sb2.example.test"})
        assert r.json() == {"node": "b", "path": "/x", "sandbox": "sb2", "port": "8080"}
        assert b.seen[-1][2]["host"] == "8080-sb2.example.test"
        r = await plain.get("/health", headers={"E2b-Sandbox-Id": "gone",
                                                "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
        # moved to a (by another gateway): b's 502 drops the cached route at once
        route = {"E2b-Sandbox-Id": "sb2", "E2b-Sandbox-Port": "49983"}
        b.gone.add("sb2")
        await reg.publish(NodeRecord("a", a.url, "t"), [IndexEntry("sb2")])
        assert (await plain.get("/health", headers=route)).status_code == 502
        assert (await plain.get("/health", headers=route)).json()["node"] == "a"
        # its node does not answer (the cached route says d): looked up again, and sent
        # once more where the sandbox is now
        dead = f"http://127.0.0.1:{free_port()}"
        await reg.publish(NodeRecord("d", dead, "t"), [IndexEntry("sb4")])
        sb4 = {**route, "E2b-Sandbox-Id": "sb4"}
        assert (await plain.get("/health", headers=sb4)).status_code == 502  # nowhere else
        await reg.publish(NodeRecord("a", a.url, "t"), [IndexEntry("sb2"), IndexEntry("sb4")])
        r = await plain.get("/health", headers=sb4)
        assert r.status_code == 200 and r.json()["node"] == "a"
        # a node past its TTL: not routed, once the route the gateway reuses expired
        monkeypatch.setattr("aenv.cluster.gateway.ROUTE_CACHE_S", 0.3)
        await reg.publish(NodeRecord("b", b.url, "t"), [IndexEntry("sb3")])
        sb3 = {**route, "E2b-Sandbox-Id": "sb3"}
        assert (await plain.get("/health", headers=sb3)).json()["node"] == "b"
        await reg.leave("b")
        await asyncio.sleep(0.4)
        r = await plain.get("/health", headers=sb3)
        assert r.status_code == 502


async def test_nodes_are_reported(cluster) -> None:
    reg, client, a, _ = cluster
    await reg.publish(NodeRecord("a", a.url, "0.1.0", max_sandboxes=64),
                      [IndexEntry("x"), IndexEntry("y", running=False)])
    await reg.publish(NodeRecord("a", a.url, "0.1.0", running=1, paused=1, max_sandboxes=64,
                                 max_starting=8, vcpus=32, memory_mb=49152, starting=1,
                                 vcpus_used=2, memory_used_mb=1024),
                      [IndexEntry("x"), IndexEntry("y", running=False)])
    await reg.leave("b")
    nodes = (await client.get("/nodes")).json()
    assert [(n["nodeID"], n["status"]) for n in nodes] == [("a", "ready"), ("b", "unhealthy")]
    one = (await client.get("/nodes/a")).json()
    assert one["url"] == a.url and one["version"] == "0.1.0"
    assert one["sandboxes"] == {"running": 1, "paused": 1, "starting": 1, "queued": 0}
    assert one["capacity"] == {"maxSandboxes": 64, "maxStarting": 8, "startQueue": 0,
                               "cpuCount": 32, "memoryMB": 49152}
    assert one["usage"] == {"cpuCount": 2, "memoryMB": 1024}
    assert (await client.get("/nodes/zz")).status_code == 404
    assert (await client.get("/nodes", headers={"X-API-KEY": ""})).status_code == 401


@dataclass
class Served:
    """An ASGI app to serve on a free port (the gateway itself, for WebSockets)."""

    app: Any
    port: int = field(default_factory=free_port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


async def test_websockets_pass_through_to_the_sandboxs_node(cluster, redis_server) -> None:
    import websockets

    reg, _, a, _ = cluster
    await reg.publish(NodeRecord("a", a.url, "t"), [IndexEntry("sb3")])
    gw = Gateway(Registry.from_url(redis_server.url(1)), api_key=KEY, cluster_secret=SECRET)
    try:
        async with serving(Served(gw.app)) as served, websockets.connect(
                f"ws://127.0.0.1:{served.port}/stream",
                additional_headers={"E2b-Sandbox-Id": "sb3",
                                    "E2b-Sandbox-Port": "8080"}) as ws:
            hello = json.loads(await ws.recv())
            assert hello == {"node": "a", "sandbox": "sb3", "port": "8080",
                             "path": "/stream"}
            await ws.send("ping")
            assert await ws.recv() == "ping"
            await ws.send(b"\x00\x01")
            assert await ws.recv() == b"\x00\x01"
    finally:
        await gw.close()
