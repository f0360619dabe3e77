"""``network.httpsPorts``: the proxy speaks TLS to a sandbox port whose service does, and
does not verify its certificate (E2B), for HTTP and WebSocket alike; the client's side
does not change. A real uvicorn with the proxy in front, and behind it TLS servers with a
self-signed certificate on a loopback address of their own."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import websockets

from aenv.egress.ca import EgressCA
from tests.proxy.helpers import listen_on_free_loopback, serving_front

TLS_PORT, WSS_PORT, PLAIN_PORT = 8443, 8444, 8080


class Upstream:
    """HTTP/1 over TLS on TLS_PORT, a WebSocket echo over TLS on WSS_PORT and plain HTTP
    on PLAIN_PORT, each answering what it is and the Host it was sent."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.tls, self.host, self.servers = tls, "", []

    async def start(self) -> None:
        async def listen(host: str) -> None:
            self.servers.append(await asyncio.start_server(
                lambda r, w: self._http(r, w, "tls"), host, TLS_PORT, ssl=self.tls))
            self.servers.append(await asyncio.start_server(
                lambda r, w: self._http(r, w, "plain"), host, PLAIN_PORT))
            self.servers.append(await websockets.serve(self._ws, host, WSS_PORT, ssl=self.tls))

        self.host = await listen_on_free_loopback(listen, self.close, "the TLS upstream")

    async def close(self) -> None:
        for s in self.servers:
            s.close()
            await s.wait_closed()
        self.servers = []

    @staticmethod
    async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    what: str) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            host = next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                         if line.lower().startswith("host:")), "")
            body = f"{what} {host}".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _ws(ws: websockets.ServerConnection) -> None:
        async for message in ws:
            await ws.send(f"wss {message}")


@pytest.fixture
async def upstream(tmp_path: Path) -> AsyncIterator[Upstream]:
    cert, key = EgressCA(tmp_path / "ca").leaf("sandbox.invalid")  # nobody trusts it
    pem = tmp_path / "leaf.pem"
    pem.write_bytes(cert + key)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(pem))
    up = Upstream(tls)
    await up.start()
    try:
        yield up
    finally:
        await up.close()


def _to(port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": "sbxtls", "E2b-Sandbox-Port": str(port)}


async def test_a_listed_port_is_reached_over_tls_without_verification(upstream) -> None:
    async with serving_front(upstream.host, "h11",
                             https_ports=frozenset({TLS_PORT, WSS_PORT})) as (port, _), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        r = await c.get("/", headers=_to(TLS_PORT))
        assert r.status_code == 200 and r.text == f"tls {upstream.host}:{TLS_PORT}"
        # Other ports are plain, as before.
        r = await c.get("/", headers=_to(PLAIN_PORT))
        assert r.status_code == 200 and r.text.startswith("plain ")
        async with websockets.connect(f"ws://127.0.0.1:{port}/echo",
                                      additional_headers=_to(WSS_PORT)) as ws:
            await ws.send("hello")
            assert await asyncio.wait_for(ws.recv(), 10) == "wss hello"


async def test_an_unlisted_tls_port_is_spoken_to_in_plain_http(upstream) -> None:
    """Without ``httpsPorts`` the TLS server gets cleartext and gives no HTTP answer: the
    client gets the proxy's 502, nothing hangs."""
    async with serving_front(upstream.host, "h11") as (port, _), \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as c:
        r = await c.get("/", headers=_to(TLS_PORT))
        assert r.status_code == 502
