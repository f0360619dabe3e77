"""Only the server opens connections to sandboxes: its sockets carry ``SERVER_MARK``.

A slot's host address (``10.11.x.y``, DNAT-ed to the guest) is routed on the host, so any
local process could connect to it and bypass the proxy's traffic-token check of a private
sandbox. With ``SlotPool(server_only=True)`` the host table's output chain refuses every
new packet to aenv's host range whose ``SO_MARK`` is not ``SERVER_MARK`` (ICMP errors
about a guest's own flows excepted), so only sockets made by ``mark_socket``,
``connect_socket`` or ``sandbox_transport`` get through.

Why a socket mark: setting one needs CAP_NET_ADMIN or CAP_NET_RAW, which unprivileged
users and processes lack, and it works the same under systemd, in a container and on a
bare shell, where a uid match (root is not only the server) or a cgroup match (a shell's
session scope holds everything started from it; a container's cgroup path is not what
the host's nft sees) would not. What it cannot keep out is a process with those
capabilities in aenv's namespace: it can set the mark, or rewrite the ruleset anyway.

The mark must be set before ``connect``, so the SYN carries it: httpx's
``socket_options`` are applied after the connection is made and would not do.
``mark_socket`` returns False where the process may not set marks (the CLI as a plain
user); its connections to sandboxes are then refused where the restriction is on, and
nothing else changes. httpx and httpcore are imported only by ``sandbox_transport``.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

# 0x0ae00000 ("ae"): clear of the bits kube-proxy (0xc000), Cilium (0xf00) and Tailscale
# (0xff0000 for 0x40000/0x80000) use, and of WireGuard's 51820, so no policy routing rule
# of theirs takes the server's connections elsewhere.
SERVER_MARK = 0x0AE00000


def mark_socket(sock: socket.socket, mark: int = SERVER_MARK) -> bool:
    """Set ``SO_MARK`` on ``sock`` (before it connects); False when not permitted."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    except PermissionError:
        return False
    return True


async def connect_socket(host: str, port: int, *, timeout: float | None = None,
                         local_address: str | None = None,
                         mark: int = SERVER_MARK) -> socket.socket:
    """A TCP socket connected to ``host:port`` whose SYN already carried ``mark``;
    non-blocking, for ``loop.create_connection(sock=)`` and ``websockets.connect(sock=)``.
    Raises OSError (TimeoutError after ``timeout`` seconds)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    async with asyncio.timeout(timeout):
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                mark_socket(sock, mark)
                if family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if local_address is not None:
                    sock.bind((local_address, 0))
                await loop.sock_connect(sock, address)
                return sock
            except OSError as e:
                sock.close()
                error = e
            except BaseException:
                sock.close()
                raise
    raise error


def sandbox_transport(*, verify: Any = True, limits: httpx.Limits | None = None,
                      http1: bool = True, http2: bool = False, retries: int = 0,
                      mark: int = SERVER_MARK) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose TCP connections are made by ``connect_socket``: hand it
    to ``httpx.AsyncClient(transport=...)`` (the client's own ``verify``/``limits`` are
    not used then; pass them here). Connect errors are httpx's, as with its own."""
    import httpcore
    import httpx
    from httpcore._backends.anyio import AnyIOStream

    class MarkedBackend(httpcore.AnyIOBackend):
        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: str | None = None,
                              socket_options: Any = None) -> httpcore.AsyncNetworkStream:
            import anyio.abc

            try:
                sock = await connect_socket(host, port, timeout=timeout,
                                            local_address=local_address, mark=mark)
            except TimeoutError as e:
                raise httpcore.ConnectTimeout(str(e) or "connect timed out") from e
            except OSError as e:
                raise httpcore.ConnectError(str(e)) from e
            try:
                for option in socket_options or ():
                    sock.setsockopt(*option)
                stream = await anyio.abc.SocketStream.from_socket(sock)
            except BaseException:
                sock.close()
                raise
            return AnyIOStream(stream)

    limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
    ssl_context = httpx.create_ssl_context(verify=verify, trust_env=False)  # built once
    transport = httpx.AsyncHTTPTransport(verify=ssl_context, limits=limits, http1=http1,
                                         http2=http2, retries=retries, trust_env=False)
    # httpx takes no network backend, httpcore's pool does: the same pool, with ours.
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, http1=http1, http2=http2,
        retries=retries, network_backend=MarkedBackend())
    return transport
