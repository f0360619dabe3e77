"""``EnvdClient.init(wait=…)``: the restore path's readiness check is the /init itself."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from aenv.client.envd import EnvdClient, EnvdError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LateEnvd:
    """An HTTP listener that answers every request 204 and counts the /init bodies."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.inits: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        if head.startswith(b"POST /init "):
            self.inits.append(body)
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_init_waits_for_a_late_listener_and_is_sent_once() -> None:
    port = _free_port()
    envd = LateEnvd(port)
    client = EnvdClient(f"http://127.0.0.1:{port}")
    try:
        starter = asyncio.get_running_loop().call_later(
            0.3, lambda: asyncio.ensure_future(envd.start()))
        await client.init(access_token="tok", env_vars={"A": "1"}, wait=5)
        starter.cancel()
        assert len(envd.inits) == 1 and b'"accessToken":"tok"' in envd.inits[0].replace(b" ", b"")
        assert b'"timestamp"' in envd.inits[0]
    finally:
        await client.aclose()
        await envd.stop()


async def test_init_without_wait_fails_at_once_on_refused_connect() -> None:
    client = EnvdClient(f"http://127.0.0.1:{_free_port()}")
    try:
        with pytest.raises(httpx.ConnectError):
            await client.init(access_token=None, env_vars={})
    finally:
        await client.aclose()


async def test_init_stops_waiting_when_the_vm_is_gone() -> None:
    client = EnvdClient(f"http://127.0.0.1:{_free_port()}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        with pytest.raises(EnvdError, match="exited"):
            await client.init(access_token=None, env_vars={}, wait=30, alive=lambda: False)
    finally:
        await client.aclose()
    assert loop.time() - t0 < 5
