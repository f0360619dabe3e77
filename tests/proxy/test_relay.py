"""The gateway's HTTP/1.1 relay to a node (``aenv.proxy.relay``) against a real uvicorn
on loopback (the node's listener) and a raw socket server that misbehaves on purpose.

What must hold: requests and bodies arrive as sent (Content-Length and chunked), answers
are relayed with their status and headers and streamed chunk by chunk as they come (not
at the end), keep-alive connections are reused, a connection the node closed while idle
costs no request, and a failure is ``UpstreamUnavailable`` before the status line and
``UpstreamLost`` after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from aenv.proxy.relay import Relay, UpstreamLost, UpstreamUnavailable, body_source
from tests.conftest import free_port


class Node:
    """An ASGI app that echoes requests, streams on /stream, and records connections."""

    def __init__(self) -> None:
        self.clients: list[tuple[str, int]] = []
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.clients.append(tuple(scope["client"]))
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/empty":  # no body, no framing: complete after its head
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if scope["path"] == "/stream":  # two parts, the second only once released
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/connect+json")]})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"second"})
            return
        headers = dict(scope["headers"])
        answer = (f"{scope['method']} {scope['path']}?{scope['query_string'].decode()} "
                  f"host={headers.get(b'host', b'').decode()} "
                  f"te={headers.get(b'transfer-encoding', b'').decode()} "
                  f"len={len(body)} ").encode() + body
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"x-node", b"yes"), (b"content-length",
                                                      str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


@contextlib.asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", **options))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


class Sent:
    """An ASGI ``send`` that records what the relay sends the client."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.got_body = asyncio.Event()

    async def __call__(self, msg: dict[str, Any]) -> None:
        self.messages.append(msg)
        if msg.get("body"):
            self.got_body.set()

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


def receiving(*parts: bytes) -> Any:
    queue = list(parts) or [b""]

    async def receive() -> dict[str, Any]:
        chunk = queue.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

    return receive


async def call(relay: Relay, method: str, target: bytes, *parts: bytes,
               headers: list[tuple[bytes, bytes]] | None = None) -> Sent:
    sent = Sent()
    hs = headers if headers is not None else [(b"host", b"49983-sbx.example.com")]
    await relay.relay(method, target, hs, body_source(receiving(*parts), hs, method), sent)
    return sent


async def test_requests_and_answers_pass_and_connections_are_reused() -> None:
    node = Node()
    async with serving(node) as port:
        relay = Relay("127.0.0.1", port)
        try:
            sent = await call(relay, "GET", b"/health?x=1")
            assert sent.status == 201 and (b"x-node", b"yes") in sent.messages[0]["headers"]
            empty = await call(relay, "GET", b"/empty")
            assert empty.status == 204 and empty.body == b""
            assert sent.body == b"GET /health?x=1 host=49983-sbx.example.com te= len=0 "
            body = b"x" * 5000
            sent = await call(relay, "POST", b"/process.Process/Start", body[:100], body[100:],
                              headers=[(b"content-length", b"5000")])
            assert sent.body.endswith(b"len=5000 " + body)
            # a small body of unknown length is held and sent with its length
            sent = await call(relay, "PUT", b"/files", b"ab", b"cd",
                              headers=[(b"transfer-encoding", b"chunked")])
            assert b"te= len=4 abcd" in sent.body
            # a large one goes chunked, what was read ahead first, on a connection of its own
            parts = [bytes([65 + i % 26]) * 100_000 for i in range(4)]
            sent = await call(relay, "PUT", b"/files", *parts,
                              headers=[(b"transfer-encoding", b"chunked")])
            assert sent.body.endswith(b"te=chunked len=400000 " + b"".join(parts))
            # a large body is streamed, on a connection of its own
            big = b"y" * (300 * 1024)
            sent = await call(relay, "POST", b"/files", big[:1000], big[1000:],
                              headers=[(b"content-length", str(len(big)).encode())])
            assert sent.body.endswith(b"len=307200 " + big)
        finally:
            await relay.close()
    # the first four (a 204 and a held chunked body among them) on one kept-alive
    # connection; the streamed bodies on new ones
    assert node.clients[0] == node.clients[1] == node.clients[2] == node.clients[3]
    assert len({node.clients[0], node.clients[4], node.clients[5]}) == 3


async def test_a_streamed_answer_is_relayed_as_it_comes() -> None:
    node = Node()
    async with serving(node) as port:
        relay = Relay("127.0.0.1", port)
        sent = Sent()
        hs: list[tuple[bytes, bytes]] = []
        task = asyncio.create_task(relay.relay("POST", b"/stream", hs,
                                               body_source(receiving(), hs, "POST"), sent))
        try:
            await asyncio.wait_for(sent.got_body.wait(), 5)   # before the node's end
            assert sent.status == 200 and sent.body == b"first" and not task.done()
            node.release.set()
            await asyncio.wait_for(task, 5)
            assert sent.body == b"firstsecond"
            assert not sent.messages[-1].get("more_body")      # the end, sent once
            assert all(m.get("more_body") for m in sent.messages[1:-1])
        finally:
            node.release.set()
            await relay.close()


async def test_a_connection_the_node_closed_while_idle_costs_no_request() -> None:
    node = Node()
    async with serving(node, timeout_keep_alive=1) as port:
        relay = Relay("127.0.0.1", port)
        try:
            assert (await call(relay, "GET", b"/a")).status == 201
            await asyncio.sleep(1.5)                    # the node closed it meanwhile
            assert (await call(relay, "POST", b"/b", b"data",
                               headers=[(b"content-length", b"4")])).status == 201
            assert len(set(node.clients)) == 2
        finally:
            await relay.close()


async def misbehaving(answer: bytes) -> tuple[asyncio.Server, int]:
    """A raw server that reads one request head, writes ``answer`` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("answer", [b"", b"garbage\r\n\r\n"])
async def test_no_answer_is_unavailable_and_nothing_reaches_the_client(answer: bytes) -> None:
    server, port = await misbehaving(answer)
    relay = Relay("127.0.0.1", port)
    sent = Sent()
    try:
        with pytest.raises(UpstreamUnavailable):
            await relay.relay("GET", b"/", [], body_source(receiving(), [], "GET"), sent)
        assert sent.messages == []
    finally:
        await relay.close()
        server.close()
    dead = Relay("127.0.0.1", free_port(), connect_timeout=1)
    with pytest.raises(UpstreamUnavailable, match="cannot connect"):
        await dead.relay("GET", b"/", [], body_source(receiving(), [], "GET"), sent)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nten bytes.",
])
async def test_an_answer_broken_off_is_lost_after_its_status_line(answer: bytes) -> None:
    server, port = await misbehaving(answer)
    relay = Relay("127.0.0.1", port)
    sent = Sent()
    try:
        with pytest.raises(UpstreamLost):
            await relay.relay("GET", b"/", [], body_source(receiving(), [], "GET"), sent)
        assert sent.status == 200 and sent.body in (b"first", b"ten bytes.")
    finally:
        await relay.close()
        server.close()


async def test_a_body_that_ends_with_the_connection_is_whole() -> None:
    server, port = await misbehaving(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nto the end")
    relay = Relay("127.0.0.1", port)
    try:
        sent = Sent()
        await relay.relay("GET", b"/", [], body_source(receiving(), [], "GET"), sent)
        assert sent.status == 200 and sent.body == b"to the end"
        assert all(k.lower() != b"connection" for k, _ in sent.messages[0]["headers"])
    finally:
        await relay.close()
        server.close()
