"""The proxy when its upstream goes away mid-request (a sandbox killed mid-command).

E2B's proxy resets the connections to a removed sandbox and aborts the response it was
streaming (an HTTP/2 stream reset); the SDKs read that reset (plus ``/health`` answering
502) as "the sandbox was killed". Over HTTP/1.1 the same signal is a TCP reset: once the
status line is out, the client's connection must be reset before the body ends. A plain
close (FIN) is not enough: E2B Python 2.45 then reports "unexpected EOF during chunk size
line ... likely due to sandbox timeout". Before the status line, the client gets E2B's 502
JSON. The server logs the event as one line, without a traceback. A real uvicorn (h11 and
httptools) sits in front of the proxy and a fake envd behind it that misbehaves on
purpose.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
import websockets

from aenv.proxy import ProxyRouter
from aenv.proxy.router import ENVD_PORT
from tests.proxy.helpers import listen_on_free_loopback, serving_front

SANDBOX = "sbxkilled"
WS_PORT = 3000
START = b'{"event":{"start":{"pid":7}}}'
ENVELOPE = b"\x00" + struct.pack(">I", len(START)) + START  # a Connect message envelope


class MisbehavingEnvd:
    """Answers every request as ``mode`` says, then fails on purpose.

    ``connect+json``: 200 chunked Connect stream, one envelope, then a TCP reset.
    ``length``: 200 with Content-Length 100, ten bytes, then a reset.
    ``hang``: 200 chunked, one envelope, then silence (a VM that stopped answering).
    ``before``: a reset before any response.
    ``silent``: no response at all (a VM that stopped before answering).
    """

    def __init__(self) -> None:
        self.mode = "connect+json"
        self.host = ""
        self.servers: list = []
        self.closing = asyncio.Event()  # ends the handlers that went silent

    async def start(self) -> None:
        async def listen(host: str) -> None:
            self.servers.append(await asyncio.start_server(self._serve, host, ENVD_PORT))
            self.servers.append(await websockets.serve(self._ws, host, WS_PORT))

        self.host = await listen_on_free_loopback(listen, self.close, "the fake envd")

    async def close(self) -> None:
        self.closing.set()
        for s in self.servers:
            s.close()
            await s.wait_closed()
        self.servers.clear()

    async def _ws(self, ws) -> None:
        await ws.send("hello")
        await self.closing.wait()  # never answers again

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if self.mode == "before":
            return _reset(writer)
        if self.mode == "silent":
            await self.closing.wait()
            return writer.close()
        if self.mode == "length":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                         b"Content-Length: 100\r\n\r\n" + b"x" * 10)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         + f"{len(ENVELOPE):x}\r\n".encode() + ENVELOPE + b"\r\n")
        await writer.drain()
        if self.mode == "hang":
            await self.closing.wait()
            return writer.close()
        await asyncio.sleep(0.2)
        _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@pytest.fixture(params=["h11", "httptools"])
async def proxy(request) -> AsyncIterator[tuple[int, MisbehavingEnvd, ProxyRouter]]:
    envd = MisbehavingEnvd()
    await envd.start()
    try:
        # log_config=None: uvicorn's records reach the root logger, so caplog sees them.
        async with serving_front(envd.host, request.param, log_config=None) as (port, router):
            yield port, envd, router
    finally:
        await envd.close()


ROUTING = {"E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": str(ENVD_PORT)}


class Received:
    """What a raw HTTP/1.1 client got: the bytes, and how the connection ended."""

    def __init__(self) -> None:
        self.data = b""
        self.ended = ""  # "reset" (TCP RST) or "closed" (FIN)

    @property
    def body(self) -> bytes:
        return self.data.partition(b"\r\n\r\n")[2]


async def _stream(port: int, got: Received) -> None:
    """POST a Start as the SDK does (one request envelope) and read to the end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"\x00\x00\x00\x00\x02{}"
    writer.write(f"POST /process.Process/Start HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"E2b-Sandbox-Id: {SANDBOX}\r\nE2b-Sandbox-Port: {ENVD_PORT}\r\n"
                 f"Content-Type: application/connect+json\r\n"
                 f"Content-Length: {len(request)}\r\n\r\n".encode() + request)
    await writer.drain()
    try:
        while chunk := await reader.read(65536):
            got.data += chunk
        got.ended = "closed"
    except ConnectionResetError:
        got.ended = "reset"
    finally:
        writer.close()


def _problems(caplog) -> list[str]:
    """Records that would put an error or a traceback in the server log."""
    return [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info]


def _proxy_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aenv.proxy"]


@pytest.mark.parametrize("mode", ["connect+json", "length"])
async def test_a_reset_mid_response_resets_the_client_connection_before_the_body_ends(
        proxy, caplog, mode) -> None:
    port, envd, _ = proxy
    envd.mode = mode
    caplog.set_level(logging.INFO)
    got = Received()
    await asyncio.wait_for(_stream(port, got), 5)
    assert got.data.startswith(b"HTTP/1.1 200 ")
    assert ENVELOPE in got.body if mode == "connect+json" else got.body == b"x" * 10
    assert not got.body.endswith(b"0\r\n\r\n")  # no last chunk
    assert got.ended == "reset"
    assert _problems(caplog) == []
    (line,) = _proxy_lines(caplog)
    assert SANDBOX in line and "upstream connection lost while streaming" in line


async def test_forget_ends_a_stream_from_a_sandbox_that_stopped_answering(
        proxy, caplog) -> None:
    port, envd, router = proxy
    envd.mode = "hang"
    caplog.set_level(logging.INFO)
    got = Received()
    client = asyncio.create_task(_stream(port, got))
    while ENVELOPE not in got.body:
        await asyncio.sleep(0.02)
    await router.forget(SANDBOX)
    await asyncio.wait_for(client, 3)
    assert not got.body.endswith(b"0\r\n\r\n")
    assert got.ended == "reset"
    assert _problems(caplog) == []
    (line,) = _proxy_lines(caplog)
    assert line == (f"sandbox {SANDBOX}: stopped while streaming /process.Process/Start "
                    "(application/connect+json); resetting the client's connection")


async def test_a_reset_before_the_response_is_e2bs_sandbox_not_found_502(
        proxy, caplog) -> None:
    port, envd, _ = proxy
    envd.mode = "before"
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(f"http://127.0.0.1:{port}/health", headers=ROUTING)
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    assert json.loads(r.content) == {
        "sandboxId": SANDBOX, "message": "The sandbox was not found", "code": 502}
    assert _problems(caplog) == []


async def test_forget_before_the_response_is_e2bs_sandbox_not_found_502(
        proxy, caplog) -> None:
    port, envd, router = proxy
    envd.mode = "silent"
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(timeout=10) as c:
        asking = asyncio.create_task(c.get(f"http://127.0.0.1:{port}/health", headers=ROUTING))
        while SANDBOX not in router._clients:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        await router.forget(SANDBOX)
        r = await asyncio.wait_for(asking, 3)
    assert r.status_code == 502
    assert r.json() == {"sandboxId": SANDBOX, "message": "The sandbox was not found",
                        "code": 502}
    assert _problems(caplog) == []
    (line,) = _proxy_lines(caplog)
    assert line == f"sandbox {SANDBOX}: stopped before it answered /health"


async def test_forget_closes_websockets_to_the_sandbox_with_1011(proxy, caplog) -> None:
    port, _, router = proxy
    caplog.set_level(logging.INFO)
    async with websockets.connect(
            f"ws://127.0.0.1:{port}/", additional_headers={
                "E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": str(WS_PORT)}) as ws:
        assert await asyncio.wait_for(ws.recv(), 5) == "hello"
        await router.forget(SANDBOX)
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 3)
        assert ws.close_code == 1011
    assert _problems(caplog) == []
    assert any(SANDBOX in line and "websocket" in line for line in _proxy_lines(caplog))
