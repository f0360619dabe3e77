"""With ``SlotPool(server_only=True)`` only sockets carrying ``SERVER_MARK`` (the server's,
made through ``aenv.network.access``) open connections to a sandbox's host address."""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from aenv.network import GUEST_IP, SERVER_MARK, connect_socket, mark_socket, sandbox_transport
from aenv.network import netns as ns

from .helpers import INET_PEER_IP, Listener, blocked, connect

pytestmark = pytest.mark.net


@pytest.fixture
def sandbox(pool_factory, make_guest):
    """A slot of a ``server_only`` pool with a guest behind it."""
    pool = pool_factory(server_only=True)
    return make_guest(pool.acquire())


@pytest.fixture
def guest_http(sandbox) -> Iterator[int]:
    """An HTTP server in the guest; yields its port."""

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"hello from the guest"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ns.run_in(sandbox.netns, lambda: http.server.ThreadingHTTPServer((GUEST_IP, 0),
                                                                              Hello))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(2)


def test_an_unmarked_host_process_cannot_reach_a_sandbox(sandbox):
    lis = Listener(sandbox.netns, GUEST_IP, 0, "guest")
    try:
        assert blocked(None, sandbox.slot.host_ip, lis.port)
        assert connect(None, sandbox.slot.host_ip, lis.port, mark=SERVER_MARK).startswith(
            "guest ")
        assert blocked(None, sandbox.slot.host_ip, lis.port, mark=SERVER_MARK + 1)
    finally:
        lis.close()


def test_an_unprivileged_process_can_neither_mark_its_socket_nor_connect(sandbox):
    lis = Listener(sandbox.netns, GUEST_IP, 0, "guest")
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                os.setgid(4321)
                os.setuid(4321)
                s = socket.socket()
                s.settimeout(1)
                if not mark_socket(s):  # EPERM without CAP_NET_ADMIN/CAP_NET_RAW
                    try:
                        s.connect((sandbox.slot.host_ip, lis.port))
                        code = 2
                    except OSError:
                        code = 0
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        lis.close()


def test_the_sandbox_transport_reaches_a_sandbox_where_plain_httpx_is_refused(sandbox,
                                                                              guest_http):
    url = f"http://{sandbox.slot.host_ip}:{guest_http}/"

    async def fetch() -> str:
        async with httpx.AsyncClient(transport=sandbox_transport(), trust_env=False,
                                     timeout=5) as client:
            r = await client.get(url)
            assert r.status_code == 200
            text = r.text
        async with httpx.AsyncClient(trust_env=False, timeout=2) as plain:
            with pytest.raises(httpx.ConnectError):
                await plain.get(url)
        return text

    assert asyncio.run(fetch()) == "hello from the guest"


def test_the_sandbox_transport_reports_a_refused_connection_as_httpx_does(sandbox):
    async def fetch() -> None:
        async with httpx.AsyncClient(transport=sandbox_transport(), trust_env=False,
                                     timeout=2) as client:
            await client.get(f"http://{sandbox.slot.host_ip}:1/")  # nothing listens

    with pytest.raises(httpx.ConnectError):
        asyncio.run(fetch())


def test_connect_socket_hands_over_a_marked_connection(sandbox):
    """What ``websockets.connect(sock=...)`` or ``loop.create_connection(sock=...)`` use."""
    lis = Listener(sandbox.netns, GUEST_IP, 0, "guest")

    async def read_line() -> bytes:
        sock = await connect_socket(sandbox.slot.host_ip, lis.port, timeout=3)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == SERVER_MARK
        reader, writer = await asyncio.open_connection(sock=sock)
        line = await reader.readline()
        writer.close()
        return line

    try:
        assert asyncio.run(read_line()).startswith(b"guest ")
    finally:
        lis.close()


def test_guests_are_not_hindered_by_it(sandbox, internet):
    assert connect(sandbox.netns, INET_PEER_IP, internet.public.port).startswith("internet ")
