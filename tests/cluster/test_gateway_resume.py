"""Resuming a paused sandbox elsewhere, through the gateway, against real Redis and fake
nodes (no VMs): its node full (429) or gone, the gateway sends the resume to a node that
can restore its snapshot and never to one that cannot, and says why when none can."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        self.seen.append(scope["path"])
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
