"""A client that leaves a streamed answer: the proxy closes its connection to the guest.

uvicorn drops what an app sends after the client disconnected without telling it, so a
stream that never ends by itself (e2b-code-interpreter's ``/execute`` past the SDK's
``timeout``: the server sends keepalives while the cell runs) used to keep the guest's
connection open, and the guest never learnt the client was gone (it interrupts the cell
when it does). A real uvicorn in front, a fake guest behind that streams a line every
0.2 s until its connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.proxy.helpers import listen_on_free_loopback, serving_front

PORT = 49999
SANDBOX = "sbxgone"


class EndlessStream:
    """Answers every request with a chunked stream of keepalive lines; ``ended`` is set
    when the proxy's connection to it closes."""

    def __init__(self) -> None:
        self.host = ""
        self.server: asyncio.Server | None = None
        self.ended = asyncio.Event()

    async def start(self) -> None:
        async def listen(host: str) -> None:
            self.server = await asyncio.start_server(self._serve, host, PORT)

        self.host = await listen_on_free_loopback(listen, self.close, "the endless stream")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        line = b'{"type": "keepalive"}\n'
        try:
            while True:
                writer.write(b"%x\r\n%b\r\n" % (len(line), line))
                await writer.drain()
                if reader.at_eof():
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 0.2)  # b"" once closed
                if reader.at_eof():
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            self.ended.set()
            writer.close()


@pytest.fixture(params=["h11", "httptools"])
async def proxied(request) -> AsyncIterator[tuple[int, EndlessStream]]:
    guest = EndlessStream()
    await guest.start()
    try:
        async with serving_front(guest.host, request.param) as (port, _):
            yield port, guest
    finally:
        await guest.close()


@pytest.mark.timeout(60)  # without the fix the server also waits on that stream at exit
async def test_a_client_leaving_a_stream_closes_the_guests_connection(proxied) -> None:
    port, guest = proxied
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"code": "while True: pass"}'
    writer.write(f"POST /execute HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {SANDBOX}\r\n"
                 f"E2b-Sandbox-Port: {PORT}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    got = b""
    while b"keepalive" not in got:  # the stream is flowing through the proxy
        got += await asyncio.wait_for(reader.read(65536), 10)
    writer.close()  # the SDK's timeout: it closes its connection
    await asyncio.wait_for(guest.ended.wait(), 5)
