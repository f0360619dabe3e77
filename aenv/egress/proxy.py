"""The egress proxy: one asyncio server per proxied slot, on a listening socket the slot
made inside its namespace (``NetworkSlot`` calls ``attach``/``detach``; the slot's nft
table redirects the guest's TCP 80 and 443 to it).

Each connection is judged before one byte goes upstream. The proxy peeks at the first
bytes without taking them (``MSG_PEEK``): a TLS ClientHello gives the SNI name, an HTTP/1
request head the Host; without either, the address the guest dialled stands as the name.
The slot's policy of that moment decides (``decide_name``); a refused connection is
closed (TLS) or answered 403 (HTTP). An allowed name is resolved
by the node (``Resolver``), never by the guest, and every address it gets must pass
``refused`` (the host, aenv's ranges, metadata) and, unless ``allowOut`` named the name,
the slot's CIDR rules: a name cannot lead where an address could not.

Then: HTTP goes upstream one request per connection (``Connection: close`` is set, so
every request's Host is judged) with the transform's headers set. TLS without a transform
is passed through as it is (end to end encrypted; the proxy never sees inside). TLS with
a transform is terminated with a certificate from the node's ``EgressCA`` for the SNI
name, the request's Host must be that name, the headers are set, and the request goes to
the real host over TLS verified against the system's CAs (and ``upstream_ca``).

``${e2b.secrets.<name>}`` in a header value is replaced by the secret's current value at
that moment (``secret``, awaited: a node's store, or a cluster's shared one in Redis); the
guest never sees it. An unknown secret, or one that cannot be read, answers 502.

The same slot's DNS (its UDP 53, redirected) is answered here too (``dns``): a refused
name does not resolve, an allowed one resolves to the addresses the proxy would dial.

A policy with an ``upstream`` (``egressProxy``) has all of the guest's TCP redirected here.
80 and 443 are judged as above; any other port by the address the guest dialled, with
the slot's CIDR rules (no byte is peeked: the server may speak first). What is allowed
then goes through the SOCKS5 proxy (``socks.open_tunnel``), never straight out: a name an
``allowOut`` domain matched as ATYP=domain (the proxy resolves it), anything else as the
IPv4 address the node would have dialled. A proxy that fails fails the connection.

Why a small asyncio proxy of our own rather than mitmproxy or Envoy: per-slot listeners
in namespaces, peek-then-splice, and one policy lookup per connection are a few hundred
lines here, against a second daemon with its own configuration channel and release train.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import socket
import ssl
import struct
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from ..network.policy import EgressPolicy
from ..network.rulesets import PROXIED_PORTS
from . import dns, sniff, socks
from .ca import EgressCA

log = logging.getLogger("aenv.egress")

# On the server's /metrics: what the proxy let through and what it turned away.
CONNECTIONS = Counter("aenv_egress_connections_total",
                      "Guest connections to the egress proxy, by outcome", ["outcome"])
DNS_QUERIES = Counter("aenv_egress_dns_queries_total",
                      "Guest DNS queries answered by the node, by answer", ["answer"])

PEEK_TIMEOUT_S = 10.0
MAX_CONNECTIONS_PER_SLOT = 512
CONNECT_TIMEOUT_S = 10.0
_SO_ORIGINAL_DST = 80
_NAMED_PORTS = frozenset(PROXIED_PORTS)  # judged by the name they carry
# Accepted sockets a transport took over (it closes them).
_TRANSPORTED: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_SECRET = re.compile(r"\$\{e2b\.secrets\.([^{}\s]+)\}")


class Refused(Exception):
    pass


class Resolver:
    """Names to IPv4 addresses as the node sees them: ``hosts_file`` (the hosts(5) format;
    re-read when it changes) first, then the system resolver."""

    def __init__(self, hosts_file: Path | None = None) -> None:
        self.hosts_file = hosts_file
        self._hosts: dict[str, list[str]] = {}
        self._mtime: float | None = None

    def _from_file(self, name: str) -> list[str]:
        if self.hosts_file is None:
            return []
        try:
            mtime = self.hosts_file.stat().st_mtime
        except OSError:
            return []
        if mtime != self._mtime:
            table: dict[str, list[str]] = {}
            for line in self.hosts_file.read_text().splitlines():
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2:
                    for host in fields[1:]:
                        table.setdefault(host.lower(), []).append(fields[0])
            self._hosts, self._mtime = table, mtime
        return self._hosts.get(name, [])

    async def resolve(self, name: str) -> list[str]:
        found = self._from_file(name)
        if found:
            return found
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except OSError:
            return []
        return list(dict.fromkeys(str(i[4][0]) for i in infos))


def original_destination(sock: socket.socket) -> tuple[str, int] | None:
    """The address and port the guest dialled, before the slot's redirect (conntrack of
    the slot's namespace, where the accepted socket lives)."""
    try:
        raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port, packed = struct.unpack_from("!H4s", raw, 2)
    return socket.inet_ntoa(packed), int(port)


async def _readable(sock: socket.socket, timeout: float) -> None:
    """Until ``sock`` has something to read (or ``timeout`` passes: TimeoutError)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, timeout)
    finally:
        loop.remove_reader(sock.fileno())


async def _peek(sock: socket.socket, parse: Callable[[bytes], object]) -> object:
    """``parse`` of the bytes waiting on ``sock``, peeked (left for whoever reads next)
    until ``parse`` stops raising NeedMore. Woken by readability while nothing waits;
    while a part waits (the socket stays readable) it looks again every 5 ms."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PEEK_TIMEOUT_S
    seen = 0
    while True:
        try:
            data = sock.recv(sniff.MAX_HEAD, socket.MSG_PEEK)
        except BlockingIOError:  # nothing yet
            try:
                await _readable(sock, max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise Refused("nothing sent") from None
            continue
        if not data:
            raise Refused("closed before a name was sent")
        if len(data) != seen:
            seen = len(data)
            try:
                return parse(data)
            except sniff.NeedMore:
                if len(data) >= sniff.MAX_HEAD:
                    raise Refused("no name in the first bytes") from None
        if loop.time() > deadline:
            raise Refused("timed out waiting for a name")
        await asyncio.sleep(0.005)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        else:  # TLS cannot half-close: closing is how the other side learns the end
            writer.close()
    except (ConnectionError, OSError, ssl.SSLError):
        pass


async def _splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                  b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for w in (a[1], b[1]):
            w.close()


def _answer(status: int, reason: str, text: str) -> bytes:
    body = text.encode() + b"\n"
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class EgressProxy:
    def __init__(self, ca: EgressCA, secret: Callable[[str], Awaitable[str | None]], *,
                 resolver: Resolver | None = None,
                 refused: Callable[[str], bool] = lambda _ip: False,
                 upstream_ca: Path | None = None,
                 proxy_refused: Callable[[str], bool] | None = None) -> None:
        """``refused``: addresses never dialled; ``proxy_refused`` (default: ``refused``):
        where a sandbox's own SOCKS proxy may not be."""
        self.ca, self._secret, self._refused = ca, secret, refused
        self._proxy_refused = proxy_refused or refused
        self.resolver = resolver or Resolver()
        self._upstream = ssl.create_default_context()
        if upstream_ca is not None:
            self._upstream.load_verify_locations(cafile=str(upstream_ca))
        self._upstream.set_alpn_protocols(["http/1.1"])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: dict[str, tuple[socket.socket, asyncio.Task[None],
                                       asyncio.DatagramTransport | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0  # handled so far (tests, metrics)
        self.refused = 0  # of them, or turned away at accept, refused

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        for key in list(self._servers):
            await self._stop(key)
        for task in list(self._tasks):
            task.cancel()

    # -- slots hand their listeners over (from worker threads) -------------------------

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None, "start() first"
        if _in_loop(self._loop):
            coro.close()
            raise RuntimeError("attach/detach block: call them from a worker thread")
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def attach(self, key: str, sock: socket.socket, policy: Callable[[], EgressPolicy],
               dns: socket.socket | None = None) -> None:
        """Serve ``sock`` (listening, in a slot's namespace; the proxy owns it from now
        on) under ``policy``, read afresh for every connection, and DNS on the UDP socket
        ``dns`` (``aenv.egress.dns``). Blocks until it serves."""
        self._call(self._serve(key, sock, policy, dns))

    def detach(self, key: str) -> None:
        """Stop serving ``key`` and close its listener (connections open stay open)."""
        self._call(self._stop(key))

    async def _serve(self, key: str, sock: socket.socket, policy: Callable[[], EgressPolicy],
                     dns: socket.socket | None) -> None:
        await self._stop(key)
        sock.setblocking(False)
        udp: asyncio.DatagramTransport | None = None
        if dns is not None:
            dns.setblocking(False)
            udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: _Dns(self, policy), sock=dns)
        self._servers[key] = (sock, asyncio.create_task(self._accept(sock, policy)), udp)

    async def _accept(self, listener: socket.socket,
                      policy: Callable[[], EgressPolicy]) -> None:
        # Accepted by hand, not by asyncio.start_server: a stream would start reading
        # the socket at once, and the first bytes must be peeked, not taken.
        loop = asyncio.get_running_loop()
        open_now = 0

        async def one(conn: socket.socket) -> None:
            nonlocal open_now
            try:
                await self._handle(conn, policy)
            finally:
                open_now -= 1

        while True:
            conn, _ = await loop.sock_accept(listener)
            if open_now >= MAX_CONNECTIONS_PER_SLOT:  # one guest cannot hold the node's
                self.refused += 1                     # memory and descriptors
                CONNECTIONS.labels("over_limit").inc()
                conn.close()
                continue
            # asyncio sets TCP_NODELAY only on sockets made with proto=IPPROTO_TCP; without
            # it a TLS close_notify waits behind the answer for the guest's delayed ACK.
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            open_now += 1
            self._track(one(conn))

    async def _stop(self, key: str) -> None:
        entry = self._servers.pop(key, None)
        if entry is not None:
            sock, task, udp = entry
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            sock.close()
            if udp is not None:
                udp.close()

    # -- one connection -------------------------------------------------------------------

    async def _handle(self, sock: socket.socket, policy: Callable[[], EgressPolicy]) -> None:
        self.connections += 1
        # Without a name (no SNI, no Host) the address the guest dialled is the name,
        # judged by the CIDR rules like any address.
        dialled, port = original_destination(sock) or ("", 443)
        writer: asyncio.StreamWriter | None = None
        try:
            now = policy()
            if now.upstream is not None and port not in _NAMED_PORTS:
                await self._tunnel_raw(sock, dialled, port, now)
                CONNECTIONS.labels("served").inc()
                return
            head = await _peek(sock, _sniff)
            if isinstance(head, sniff.RequestHead):
                reader, writer = await _streams(sock)
                await self._http(head, head.host or dialled, port, reader, writer, policy(),
                                 dialled)
            else:
                await self._tls(str(head) or dialled, port, sock, policy(), dialled)
            CONNECTIONS.labels("served").inc()
        except Refused as e:
            self.refused += 1
            CONNECTIONS.labels("refused").inc()
            log.debug("egress: refused %s", e)  # the guest decides how often: not info
        except (ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            log.debug("egress: connection ended: %s", e)
        except Exception:
            log.exception("egress: connection failed")
        finally:
            if writer is not None:
                writer.close()
            elif sock not in _TRANSPORTED:
                sock.close()

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dns(self, data: bytes, addr: Any, transport: asyncio.DatagramTransport,
                   policy: EgressPolicy) -> None:
        try:
            q = dns.parse(data)
        except dns.BadQuery:
            reply = dns.error(data, dns.FORMERR)
            if reply is not None:
                transport.sendto(reply, addr)
            return
        try:
            found = await self._upstream_addr(q.name, policy)
        except Refused:  # refused, or nowhere it may go: the name does not exist for it
            DNS_QUERIES.labels("nxdomain").inc()
            transport.sendto(dns.answer(q, dns.NXDOMAIN), addr)
            return
        DNS_QUERIES.labels("noerror").inc()
        transport.sendto(dns.answer(q, dns.NOERROR, found), addr)

    async def _tunnel_raw(self, sock: socket.socket, dialled: str, port: int,
                          policy: EgressPolicy) -> None:
        """A port other than 80 and 443 of a sandbox with an upstream proxy: the dialled
        address under the CIDR rules, then through the proxy as it is."""
        if not dialled or self._refused(dialled) or not policy.tcp_allowed(dialled, port):
            raise Refused(f"{dialled}:{port}: not allowed by the sandbox's egress rules")
        up = await self._connect([dialled], port, policy=policy)
        await _splice(await _streams(sock), up)

    async def _upstream_addr(self, name: str, policy: EgressPolicy,
                             dialled: str = "", *, dial: bool = False) -> list[str]:
        verdict = policy.decide_name(name)
        if not verdict.allowed:
            # An address allowOut lists wins over a name nothing allows: the guest may
            # reach it directly, so it may reach it under any name (and only there).
            if dialled and policy.ip_listed(dialled) and not self._refused(dialled):
                return [dialled]
            raise Refused(f"{name}: not allowed by the sandbox's egress rules")
        if dial and verdict.explicit and policy.upstream is not None:
            return []  # the upstream proxy resolves it (ATYP=domain), not the node
        addresses = [name] if _is_ip(name) else await self.resolver.resolve(name)
        ok = [a for a in addresses
              if not self._refused(a) and (verdict.explicit or policy.ip_allowed(a))]
        if not ok:
            raise Refused(f"{name}: no address it may reach ({', '.join(addresses) or 'none'})")
        return ok

    async def _connect(self, addresses: list[str], port: int, *, tls_name: str | None = None,
                       policy: EgressPolicy | None = None, name: str = ""
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Upstream to ``port`` of the first of ``addresses`` that answers (TLS to
        ``tls_name`` if given): straight, or through the policy's upstream proxy, where a
        ``name`` an allowOut domain matched goes as the name."""
        if policy is not None and policy.upstream is not None:
            targets = [name] if name and not _is_ip(name) and \
                policy.decide_name(name).explicit else addresses
            failed: Exception | None = None
            for target in targets:
                try:
                    reader, writer = await socks.open_tunnel(
                        policy.upstream, target, port, refused=self._proxy_refused,
                        timeout=CONNECT_TIMEOUT_S)
                except socks.SocksError as e:
                    failed = e
                    continue
                if tls_name:
                    try:
                        await writer.start_tls(self._upstream, server_hostname=tls_name)
                    except BaseException:
                        writer.close()
                        raise
                return reader, writer
            raise Refused(f"through the sandbox's proxy to {targets}:{port}: {failed}")
        last: Exception | None = None
        for a in addresses:
            try:
                return await asyncio.wait_for(asyncio.open_connection(
                    a, port, ssl=self._upstream if tls_name else None,
                    server_hostname=tls_name), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError, ssl.SSLError) as e:
                last = e
        raise Refused(f"upstream {addresses}:{port} unreachable: {last}")

    async def _headers(self, policy: EgressPolicy, name: str) -> tuple[tuple[str, str], ...]:
        out = []
        for key, value in policy.headers_for(name):
            values: dict[str, str] = {}
            for secret_name in sorted(set(_SECRET.findall(value))):
                try:
                    secret = await self._secret(secret_name)
                except Exception as e:  # the store is unreachable (a cluster's Redis)
                    raise _SecretError(f"secret {secret_name} could not be read "
                                       f"({type(e).__name__})") from None
                if secret is None:
                    raise _SecretError(f"unknown secret {secret_name}")
                if any(c in secret for c in "\r\n\0"):  # would split the header
                    raise _SecretError(f"secret {secret_name} cannot go in a header")
                values[secret_name] = secret

            def fill(m: re.Match[str], values: dict[str, str] = values) -> str:
                return values[m.group(1)]
            out.append((key, _SECRET.sub(fill, value)))
        return tuple(out)

    async def _http(self, head: sniff.RequestHead, name: str, port: int,
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    policy: EgressPolicy, dialled: str = "") -> None:
        await reader.readexactly(head.size)  # taken before any answer: no reset on close
        try:
            if not name:
                raise Refused("request without a Host")
            if head.target_host not in (None, name):
                raise Refused(f"the request names {head.target_host}, its Host {name}")
            addresses = await self._upstream_addr(name, policy, dialled, dial=True)
            headers = await self._headers(policy, name)
        except Refused as e:
            writer.write(_answer(403, "Forbidden", f"aenv egress: {e}"))
            await writer.drain()
            raise
        except _SecretError as e:
            writer.write(_answer(502, "Bad Gateway", f"aenv egress: {e}"))
            await writer.drain()
            raise Refused(str(e)) from None
        up = await self._connect(addresses, port, policy=policy, name=name)
        up[1].write(head.render(headers, close=True))
        await _splice((reader, writer), up)

    async def _tls(self, name: str, port: int, sock: socket.socket,
                   policy: EgressPolicy, dialled: str = "") -> None:
        if not name:
            raise Refused("TLS without SNI to an unknown address")
        addresses = await self._upstream_addr(name, policy, dialled, dial=True)
        if not policy.headers_for(name):
            up = await self._connect(addresses, port, policy=policy, name=name)
            await _splice(await _streams(sock), up)
            return
        # A transform: terminate, with a leaf of our CA for the SNI name.
        reader, writer = await _streams(sock, self.ca.server_context(name))
        try:
            await self._terminated(name, port, addresses, reader, writer, policy)
        finally:
            writer.close()

    async def _terminated(self, name: str, port: int, addresses: list[str],
                          reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          policy: EgressPolicy) -> None:
        raw = await reader.readuntil(b"\r\n\r\n")
        try:
            head = sniff.request_head(raw)
        except (sniff.NeedMore, sniff.NotParsable):
            raise Refused(f"{name}: not an HTTP/1 request inside TLS") from None
        if head.host != name or head.target_host not in (None, name):
            writer.write(_answer(421, "Misdirected Request",
                                 f"aenv egress: Host {head.host} on a connection for {name}"))
            await writer.drain()
            raise Refused(f"Host {head.host} on a TLS connection for {name}")
        try:
            headers = await self._headers(policy, name)
        except _SecretError as e:
            writer.write(_answer(502, "Bad Gateway", f"aenv egress: {e}"))
            await writer.drain()
            raise Refused(str(e)) from None
        up = await self._connect(addresses, port, tls_name=name, policy=policy, name=name)
        up[1].write(head.render(headers, close=True))
        await _splice((reader, writer), up)


class _SecretError(Exception):
    pass


class _Dns(asyncio.DatagramProtocol):
    """A slot's DNS socket: each query answered in a task of its own."""

    def __init__(self, proxy: EgressProxy, policy: Callable[[], EgressPolicy]) -> None:
        self.proxy, self.policy = proxy, policy
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram one here

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if self.transport is not None:
            self.proxy._track(self.proxy._dns(data, addr, self.transport, self.policy()))


async def _streams(sock: socket.socket, tls: ssl.SSLContext | None = None
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over an accepted socket (the server side of TLS with ``tls``); from here
    on the transport owns the socket."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2 ** 16)
    protocol = asyncio.StreamReaderProtocol(reader)
    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock, ssl=tls)
    _TRANSPORTED.add(sock)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


def _sniff(data: bytes) -> object:
    if sniff.is_tls(data):
        try:
            return sniff.sni(data) or ""
        except sniff.NotParsable as e:
            raise Refused(str(e)) from None
    try:
        return sniff.request_head(data)
    except sniff.NotParsable as e:
        raise Refused(str(e)) from None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


__all__ = ["EgressProxy", "Refused", "Resolver", "original_destination"]
