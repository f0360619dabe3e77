"""Which request paths the proxy forwards to a sandbox, and that it forwards exactly them.

envd's ``/init`` sets the access token; a request that reached it from outside could turn
envd's auth off. These tests speak raw HTTP/1.1 to a real uvicorn listener (an HTTP client
would normalise ``/./init`` before sending it) and put a fake envd behind the proxy that
records every request line it receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from aenv.proxy.router import ENVD_PORT
from tests.proxy.helpers import listen_on_free_loopback, serving_front

USER_PORT = 3000

# One proxy and fake upstream per HTTP implementation serve the whole module (starting and
# stopping uvicorn for each of ~100 cases was most of this file's time); tests run on the
# module's loop so that the servers keep running between them.
on_module_loop = pytest.mark.asyncio(loop_scope="module")


class FakeUpstream:
    """Answers every request with 200 "ok" and remembers its request line."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.servers: list[asyncio.Server] = []
        self.host = ""

    async def start(self) -> None:
        async def listen(host: str) -> None:
            for port in (ENVD_PORT, USER_PORT):
                self.servers.append(await asyncio.start_server(self._serve, host, port))

        self.host = await listen_on_free_loopback(listen, self.close, "the fake upstream")

    async def close(self) -> None:
        for s in self.servers:
            s.close()
            await s.wait_closed()
        self.servers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.seen.append(head.split(b"\r\n", 1)[0])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length:
            await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["h11", "httptools"])
async def _served(request) -> AsyncIterator[tuple[int, FakeUpstream]]:
    upstream = FakeUpstream()
    await upstream.start()
    try:
        async with serving_front(upstream.host, request.param, log_level="warning") as (port, _):
            yield port, upstream
    finally:
        await upstream.close()


@pytest.fixture
def proxy(_served: tuple[int, FakeUpstream]) -> tuple[int, FakeUpstream]:
    """The module's proxy, its upstream's record of requests emptied for this test."""
    _served[1].seen.clear()
    return _served


async def _raw(port: int, target: str, *, sandbox_port: int = ENVD_PORT,
               websocket: bool = False) -> int:
    """Send one request with ``target`` exactly as written; the response status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"{'GET' if websocket else 'POST'} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"E2b-Sandbox-Id: sbxa\r\nE2b-Sandbox-Port: {sandbox_port}\r\n")
    if websocket:
        writer.write(head.encode() + b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Version: 13\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    else:
        body = b'{"accessToken":""}'
        writer.write(head.encode() + b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    status_line = await reader.readline()
    await reader.read()
    writer.close()
    return int(status_line.split()[1])


INIT_SPELLINGS = [
    "/init", "/./init", "/x/../init", "/%2e/init", "/%2E%2E/init", "/x/%2e%2e/init",
    "//init", "/init/", "/init//", "///init", "/INIT", "/Init/", "/%69nit", "/%2finit",
    "/x%2f..%2finit", "/.%2e/init", "/x/..%2Finit", "/x/..%5cinit", "/freeze", "//upgrade/",
    "/init%zz", "/init{", "/health%", "/files\\..\\init",
]


@on_module_loop
@pytest.mark.parametrize("target", INIT_SPELLINGS)
async def test_envd_internal_routes_are_404_in_any_spelling_and_never_reach_envd(
        proxy, target) -> None:
    port, upstream = proxy
    assert await _raw(port, target) == 404
    assert upstream.seen == []


@on_module_loop
@pytest.mark.parametrize("target", ["/./init", "//init", "/%2e%2e/init", "/a/../b"])
async def test_websocket_upgrades_are_checked_the_same_way(proxy, target) -> None:
    port, upstream = proxy
    assert await _raw(port, target, websocket=True) == 403  # uvicorn's answer to a close
    assert upstream.seen == []


@on_module_loop
@pytest.mark.parametrize("target", [
    "/health", "/files?path=%2Fhome%2Fuser%2Fa%20b&username=user",
    "/process.Process/Start", "/filesystem.Filesystem/Stat", "/envs", "/initialize",
    "/files/init", "/health?x=/../init",
])
async def test_ordinary_envd_paths_pass_byte_for_byte(proxy, target) -> None:
    port, upstream = proxy
    assert await _raw(port, target) == 200
    assert upstream.seen == [f"POST {target} HTTP/1.1".encode()]


@on_module_loop
@pytest.mark.parametrize("target", ["/a%2Fb", "/api/%2e%2e-not-a-segment", "/a%20b/c",
                                    "/%7Euser/x", "/init", "//x"])
async def test_user_ports_get_the_raw_path_unchanged(proxy, target) -> None:
    """No path policy applies to user ports, so encoded bytes stay as the client sent them
    (the proxy used to decode ``%2F`` into a separator)."""
    port, upstream = proxy
    assert await _raw(port, target, sandbox_port=USER_PORT) == 200
    assert upstream.seen == [f"POST {target} HTTP/1.1".encode()]


@on_module_loop
async def test_user_ports_get_bytes_httpx_must_escape_escaped(proxy) -> None:
    port, upstream = proxy
    assert await _raw(port, "/a{b}c", sandbox_port=USER_PORT) == 200
    assert upstream.seen == [b"POST /a%7Bb%7Dc HTTP/1.1"]  # decodes to the same path


@on_module_loop
@pytest.mark.parametrize("target", ["/a/../b", "/./x", "/a/%2e%2e/b", "/a/.%2E"])
async def test_dot_segments_are_refused_on_every_port(proxy, target) -> None:
    port, upstream = proxy
    assert await _raw(port, target, sandbox_port=USER_PORT) == 404
    assert upstream.seen == []


def test_upstream_path_without_raw_path_falls_back_to_the_decoded_path() -> None:
    """ASGI servers may leave ``raw_path`` out; the decoded path is re-encoded then."""
    from aenv.proxy.router import upstream_path

    scope = {"type": "http", "path": "/a b/%41"}
    assert upstream_path(scope, USER_PORT) == b"/a%20b/%2541"
    assert upstream_path({"type": "http", "path": "/./init"}, ENVD_PORT) is None

