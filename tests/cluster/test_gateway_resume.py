"""Resuming a paused sandbox elsewhere, through the gateway, against real Redis and fake
nodes (no VMs): its node full (429) or gone, the gateway sends the resume to a node that
can restore its snapshot and never to one that cannot, and says why when none can; traffic
to an ``autoResume`` one whose node is gone resumes it there too, once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from aenv.cluster.registry import IndexEntry, NodeRecord, Registry
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_gateway import gateway_on, serving
from tests.conftest import free_port

KEY = "e2b_" + "r" * 40
SECRET = "s" * 40
TCG = {"driver": "qemu", "accel": "tcg", "cpu_model": "Any", "aenv": "0.1.0"}
REQUIRES = json.dumps({"driver": "qemu", "accel": "tcg", "cpu_model": None,
                       "kernel": "k1", "aenv": "0.1.0"})


@dataclass
class ResumeNode:
    name: str
    status: int = 200
    seen: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    # Run before a connect answers (a real node publishes its index then).
    on_connect: Callable[[], Awaitable[None]] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        self.seen.append(scope["path"])
        headers = dict(scope["headers"])
        if b"e2b-sandbox-id" in headers:  # sandbox traffic: say who answers
            body = json.dumps({"traffic": self.name,
                               "sandbox": headers[b"e2b-sandbox-id"].decode()}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["path"].endswith("/connect") and self.on_connect is not None \
                and self.status < 300:
            await asyncio.sleep(0.2)  # a resume takes a while: others' traffic waits
            await self.on_connect()
        body = json.dumps({"sandboxID": "p1", "node": self.name} if self.status < 300 else
                          {"code": self.status, "message": f"{self.name} says no"}).encode()
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


Nodes = tuple[Registry, httpx.AsyncClient, ResumeNode, ResumeNode, ResumeNode]


@pytest.fixture
async def nodes(redis_server: RedisServer) -> AsyncIterator[Nodes]:
    async with serving(ResumeNode("a")) as a, serving(ResumeNode("b")) as b, \
            serving(ResumeNode("c")) as c, \
            gateway_on(redis_server.url(4), KEY, SECRET) as (reg, client):
        await reg.publish(NodeRecord("a", a.url, "t", restores=TCG),
                          [IndexEntry("p1", running=False, requires=REQUIRES)])
        await reg.publish(NodeRecord("b", b.url, "t", running=0,
                                     restores={**TCG, "accel": "kvm"}), [])
        await reg.publish(NodeRecord("c", c.url, "t", running=3, restores=TCG), [])
        yield reg, client, a, b, c


async def test_its_node_full_the_resume_goes_to_one_that_can_restore_it(nodes: Nodes) -> None:
    _, client, a, b, c = nodes
    a.status = 429
    r = await client.post("/sandboxes/p1/connect", json={"timeout": 60})
    assert r.status_code == 200 and r.json()["node"] == "c"
    assert a.seen == ["/sandboxes/p1/connect"] and b.seen == []   # b: KVM only, not asked
    assert c.seen == ["/sandboxes/p1/connect"]


async def test_its_node_gone_and_no_node_able_says_why(nodes: Nodes) -> None:
    reg, client, a, b, c = nodes
    await reg.leave("a")
    c.status = 409                                  # c lacks the guest kernel, say
    r = await client.post("/v2/sandboxes/p1/connect", json={"timeout": 60})
    assert r.status_code == 409
    message = r.json()["message"]
    assert "paused on node a, which is gone" in message
    assert "node b: it needs the tcg accelerator, this node has kvm" in message
    assert "node c: c says no" in message
    assert a.seen == [] and b.seen == [] and c.seen == ["/v2/sandboxes/p1/connect"]
    # a running sandbox (nothing offered) of a gone node: unreachable, as before
    await reg.publish(NodeRecord("a", a.url, "t"), [IndexEntry("r1")])
    await reg.leave("a")
    assert (await client.post("/sandboxes/r1/connect", json={})).status_code == 503


async def test_traffic_to_an_auto_resume_sandbox_of_a_gone_node_resumes_it_once(
        nodes: Nodes) -> None:
    reg, api, a, b, c = nodes
    client = httpx.AsyncClient(transport=api._transport, base_url="http://gw")  # no API key
    await reg.publish(NodeRecord("a", a.url, "t", restores=TCG), [
        IndexEntry("p1", running=False, requires=REQUIRES),
        IndexEntry("p2", running=False, requires=REQUIRES, auto_resume=True)])
    assert await reg.auto_resumes("p2") and not await reg.auto_resumes("p1")

    async def c_takes_p2() -> None:
        await reg.publish(NodeRecord("c", c.url, "t", running=4, restores=TCG),
                          [IndexEntry("p2")])

    c.on_connect = c_takes_p2
    await reg.leave("a")
    route = {"E2b-Sandbox-Port": "49983"}
    answers = await asyncio.gather(*(
        client.get("/health", headers={**route, "E2b-Sandbox-Id": "p2"}) for _ in range(4)))
    assert [r.status_code for r in answers] == [200] * 4
    assert {r.json()["traffic"] for r in answers} == {"c"}
    assert c.seen.count("/sandboxes/p2/connect") == 1      # one resume for all of them
    assert b.seen == [] and a.seen == []                   # b cannot restore it; a is gone
    assert await reg.locate("p2") == "c" and not await reg.auto_resumes("p2")
    # without autoResume, traffic does not resume it: E2B's 502
    r = await client.get("/health", headers={**route, "E2b-Sandbox-Id": "p1"})
    assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
    assert "/sandboxes/p1/connect" not in c.seen
    # none able (c refuses): 502, and the next request tries again
    await reg.publish(NodeRecord("a", a.url, "t", restores=TCG), [
        IndexEntry("p3", running=False, requires=REQUIRES, auto_resume=True)])
    await reg.leave("a")
    c.status = 409
    r = await client.get("/health", headers={**route, "E2b-Sandbox-Id": "p3"})
    assert r.status_code == 502
    r = await client.get("/health", headers={**route, "E2b-Sandbox-Id": "p3"})
    assert r.status_code == 502 and c.seen.count("/sandboxes/p3/connect") == 2
    await client.aclose()
