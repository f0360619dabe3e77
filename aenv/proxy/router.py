"""Stream HTTP and WebSocket traffic to a port inside a sandbox.

Routing (spec 1.3, 1.5): ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` headers, or a Host of
``<port>-<sandboxID>.<domain>``. Bodies stream both ways, envelope by envelope, never
buffered whole. When a sandbox is gone the client gets E2B's proxy answer: 502 JSON with
"The sandbox was not found" (a running sandbox with nothing on the port: "…port is not
open"); the SDKs classify errors by those phrases.

Each running sandbox gets its own upstream connection pool keyed by the VM's identity, so
a keep-alive connection can never reach a newer VM that reuses the same address.

A sandbox that stops (``forget``, called when its VM is gone) or an upstream connection
that fails mid-response ends the client's response the way E2B's proxy does: E2B resets
every connection to a removed sandbox (``SetLinger(0)``) and Go's reverse proxy then aborts
the response it was streaming, which over HTTP/2 is a stream reset. Over HTTP/1.1 the same
signal is a TCP reset of the client's connection, and that is what the proxy sends. The
SDKs take a reset, then envd's ``/health`` answering 502 "…was not found", as "the sandbox
was killed or reached its end of life while the request was in flight". Anything else
reads differently: a plain close before the last chunk gives E2B Python 2.45 (the version
of E2B's own test suite) "unexpected EOF during chunk size line: …likely due to sandbox
timeout", and an end-of-stream frame with an ``unavailable`` error gives that in JS 2.51
too. The event is logged as one line, without a traceback. Before the status line is sent
the client gets the 502 JSON above. WebSockets to a stopped sandbox are closed with 1011.

A port the sandbox lists in ``httpsPorts`` is reached over TLS (HTTP and WebSocket),
without verifying its certificate, as E2B's proxy does; the client's side is whatever it
was (the public URL's scheme does not change).

Paths: the proxy checks a path once and forwards exactly the bytes it checked
(``upstream_path``). It never re-normalises them, so what envd routes is what was checked.
Paths with a ``.`` or ``..`` segment (also percent-encoded) are refused with 404 on every
port; on envd's port so are encoded dots, slashes and backslashes (no envd route has one),
bytes outside RFC 3986's path characters or a malformed ``%`` escape (httpx re-escapes
some of those), and envd's internal routes (``/init`` and E2B's orchestrator-only ones) in
any spelling: ``//init``, ``/init/``, ``/INIT``. On other ports httpx escapes such bytes
(``{`` -> ``%7B``), which the guest decodes to the same path.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import httpx
import websockets
from starlette.types import Receive, Scope, Send

from ..client.http import plain_client
from ..envd import ENVD_PORT
from ..network.access import connect_socket
from .relay import Relay, UpstreamLost, UpstreamUnavailable, body_source

log = logging.getLogger("aenv.proxy")

Headers = list[tuple[bytes, bytes]]  # ASGI's header list: (lower-case name, value)

_HOST = re.compile(r"^(\d{1,5})-([a-z0-9]{1,64})\.[^:]+(?::\d+)?$")
_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
}
_STRIP = {b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token", b"x-api-key",
          b"x-aenv-cluster-secret"}
# Kept when the upstream is a node (``Route.node``): the node routes and checks them itself.
_FOR_NODE = {b"e2b-traffic-access-token"}
# envd routes the orchestrator uses (aenv's envd has /init; E2B's envd also the rest, spec
# 3.2); never reachable from outside.
_ENVD_INTERNAL = frozenset({"/init", "/freeze", "/unfreeze", "/collapse", "/fsfreeze",
                            "/fsthaw", "/upgrade"})
_ENCODED_SEPARATOR = re.compile(rb"%(?:2e|2f|5c)", re.IGNORECASE)
# RFC 3986 path characters and escapes: httpx sends these on unchanged.
_PLAIN_PATH = re.compile(rb"^(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})*$")


def _unverified_tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


_UNVERIFIED = _unverified_tls()


def parse_host(host: str | None) -> tuple[int, str] | None:
    """``49983-abc123.example.com[:3000]`` -> (49983, "abc123")."""
    if not host:
        return None
    m = _HOST.match(host.lower())
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class Route:
    sandbox_id: str
    host_ip: str
    generation: str          # changes whenever the VM behind the sandbox changes
    envd_token: str | None
    traffic_token: str | None
    public_traffic: bool = True
    # ``network.maskRequestHost``: the Host user-port requests carry upstream (``${PORT}``
    # is the port); None: the guest's own address, as before.
    mask_host: str | None = None
    # A gateway's route (aenv/cluster): the sandbox lives on the node at this (host, port).
    # Requests go there with E2b-Sandbox-Id/-Port headers and the client's Host, the
    # node checks traffic tokens itself, and one connection pool serves the whole node.
    node: tuple[str, int] | None = None
    # ``network.httpsPorts``: ports whose service speaks TLS; the proxy speaks TLS to them
    # without verifying their certificate (E2B). The client's side is unchanged.
    https_ports: frozenset[int] = frozenset()

    def upstream_tls(self, port: int) -> bool:
        """Whether the hop to ``port`` is TLS (a gateway's hop to a node never is: the
        node makes it)."""
        return self.node is None and port in self.https_ports

    @property
    def pool(self) -> str:
        """What upstream connections are pooled by."""
        return f"node:{self.node[0]}:{self.node[1]}" if self.node else self.sandbox_id

    def address(self, port: int) -> tuple[str, int]:
        """Where the request's connection goes."""
        return self.node or (self.host_ip, port)

    def upstream_headers(self, scope: Scope, port: int) -> Headers:
        """The request's headers as they go upstream."""
        keep = _FOR_NODE if self.node else frozenset()
        headers: Headers = [(k, v) for k, v in scope["headers"]
                            if k not in _HOP_BY_HOP and (k not in _STRIP or k in keep)]
        if self.node:
            headers += [(b"e2b-sandbox-id", self.sandbox_id.encode()),
                        (b"e2b-sandbox-port", str(port).encode())]
        return headers

    def upstream_host(self, port: int) -> str | None:
        if port == ENVD_PORT or not self.mask_host:
            return None
        return self.mask_host.replace("${PORT}", str(port))


def upstream_path(scope: Scope, port: int) -> bytes | None:
    """The request's path as it goes upstream, byte for byte, or None to refuse it (404).

    The check runs on the path decoded once, as the upstream server decodes it, and the
    raw bytes are forwarded unchanged (see the module docstring for what is refused).
    """
    raw = scope.get("raw_path") or quote(scope["path"], safe="/:@!$&'()*+,;=~").encode()
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text.startswith("/"):
        return None
    segments = unquote(text).split("/")
    if "." in segments or ".." in segments:
        return None
    if port == ENVD_PORT:
        if _ENCODED_SEPARATOR.search(raw) or not _PLAIN_PATH.match(raw):
            return None
        canonical = "/" + "/".join(s for s in segments if s)
        if canonical.lower() in _ENVD_INTERNAL:
            return None
    return raw


class RouteTable:
    """Resolves sandbox ids to routes through a lookup the server provides.

    ``lookup(id)`` returns a Route for a running sandbox, None for an unknown one, and may
    resume a paused sandbox that has auto-resume on (the server decides).
    """

    def __init__(self, lookup: Callable[[str], Awaitable[Route | None]]) -> None:
        self.lookup = lookup


def _json(status: int, body: dict[str, Any]) -> tuple[int, Headers, bytes]:
    import json

    data = json.dumps(body).encode()
    return status, [(b"content-type", b"application/json; charset=utf-8"),
                    (b"content-length", str(len(data)).encode())], data


async def _answer(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def not_found(sandbox_id: str) -> tuple[int, Headers, bytes]:
    return _json(502, {"sandboxId": sandbox_id, "message": "The sandbox was not found",
                       "code": 502})


def port_closed(sandbox_id: str, port: int) -> tuple[int, Headers, bytes]:
    return _json(502, {"sandboxId": sandbox_id,
                       "message": "The sandbox is running but port is not open",
                       "port": port, "code": 502})


class ProxyRouter:
    """ASGI handler for requests already known to be sandbox traffic."""

    def __init__(self, routes: RouteTable, *, connect_timeout: float = 5.0) -> None:
        self.routes = routes
        self.connect_timeout = connect_timeout
        self._clients: dict[str, tuple[str, httpx.AsyncClient]] = {}  # by Route.pool
        self._relays: dict[str, tuple[str, Relay]] = {}  # a gateway's, by Route.pool
        # Off: a gateway's hop goes through httpx as a node's does (benchmarks compare).
        self.relay_to_nodes = True
        # A gateway's: called with the sandbox id when its node did not answer or answered
        # 502 (the sandbox is not there any more): a cached route to it is stale.
        self.on_stale: Callable[[str], None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._websockets: dict[str, set[websockets.ClientConnection]] = {}

    async def close(self) -> None:
        for _, client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        for _, relay in self._relays.values():
            await relay.close()
        self._relays.clear()

    async def forget(self, sandbox_id: str) -> None:
        """The sandbox stopped or moved: close its upstream connections, in use or not.

        Responses still streaming from it end at once (see the module docstring) instead of
        waiting on a connection to a VM that will never answer again.
        """
        entry = self._clients.pop(sandbox_id, None)
        if entry:
            await entry[1].aclose()
        for ws in self._websockets.pop(sandbox_id, set()):
            ws.transport.abort()

    def _client(self, route: Route) -> httpx.AsyncClient:
        entry = self._clients.get(route.pool)
        if entry and entry[0] == route.generation:
            return entry[1]
        if entry:
            closing = asyncio.create_task(entry[1].aclose())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        client = plain_client(
            # Only ``httpsPorts`` are https: their certificates are not verified (E2B).
            verify=_UNVERIFIED,
            timeout=httpx.Timeout(None, connect=self.connect_timeout),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32,
                                keepalive_expiry=60),
            follow_redirects=False,
        )
        self._clients[route.pool] = (route.generation, client)
        return client

    async def __call__(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str,
                       port: int) -> None:
        path = upstream_path(scope, port)
        if path is None:
            # Checked before the lookup, which may resume a paused sandbox.
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            return await _answer(send, *_json(404, {"code": 404, "message": "not found"}))
        route = await self.routes.lookup(sandbox_id)
        if route is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1011})
                return
            return await _answer(send, *not_found(sandbox_id))
        if not self._allowed(scope, route, port):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            return await _answer(send, *_json(
                403, {"code": 403, "message": "missing or invalid traffic access token"}))
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send, route, port, path)
        await self._http(scope, receive, send, route, port, path)

    def _allowed(self, scope: Scope, route: Route, port: int) -> bool:
        if port == ENVD_PORT or route.public_traffic:
            return True
        if not route.traffic_token:
            return False
        given = _header(scope, b"e2b-traffic-access-token") or ""
        return hmac.compare_digest(given.encode(), route.traffic_token.encode())

    def _relay(self, route: Route) -> Relay:
        assert route.node is not None
        entry = self._relays.get(route.pool)
        if entry and entry[0] == route.generation:
            return entry[1]
        if entry:
            closing = asyncio.create_task(entry[1].close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        relay = Relay(*route.node, connect_timeout=self.connect_timeout)
        self._relays[route.pool] = (route.generation, relay)
        return relay

    async def _to_node(self, scope: Scope, receive: Receive, send: Send, route: Route,
                       port: int, path: bytes) -> None:
        """A gateway's hop: the request relayed to the sandbox's node (``relay``). When the
        node does not answer, the route is dropped (``on_stale``) and looked up again:
        one that changed (the sandbox resumed elsewhere meanwhile) gets the request once
        more, when its body could be held."""
        query = scope.get("query_string")
        target = path + b"?" + query if query else path
        body = body_source(receive, scope["headers"], scope["method"])
        for attempt in (1, 2):
            headers = route.upstream_headers(scope, port)
            host = _header(scope, b"host")
            if host:
                headers.append((b"host", host.encode()))  # the node adds x-forwarded-host
            try:
                status = await self._relay(route).relay(scope["method"], target, headers,
                                                        body, send)
            except UpstreamUnavailable as e:
                log.info("sandbox %s: node failed before a response: %s", route.sandbox_id, e)
                if self.on_stale is not None:
                    self.on_stale(route.sandbox_id)
                    if attempt == 1 and body.replayable:
                        fresh = await self.routes.lookup(route.sandbox_id)
                        if fresh is not None and fresh.node is not None and \
                                fresh.generation != route.generation:
                            route = fresh
                            continue
                await _answer(send, *not_found(route.sandbox_id))
                return
            except UpstreamLost as e:
                log.warning("sandbox %s: node connection lost while streaming %s (%s); "
                            "resetting the client's connection", route.sandbox_id,
                            scope["path"], e)
                await _reset_client(send)
                return
            if status == 502 and self.on_stale is not None:
                self.on_stale(route.sandbox_id)
            return

    async def _http(self, scope: Scope, receive: Receive, send: Send, route: Route,
                    port: int, path: bytes) -> None:
        if route.node is not None and scope["method"] != "HEAD" and self.relay_to_nodes:
            return await self._to_node(scope, receive, send, route, port, path)
        # ``path`` has no dot segments, so httpx does not normalise it; it only escapes
        # some bytes outside RFC 3986's path characters (none on envd's port, see above).
        ip, upstream_port = route.address(port)
        url = httpx.URL(scheme="https" if route.upstream_tls(port) else "http", host=ip,
                        port=upstream_port, path=path.decode("ascii"),
                        query=scope.get("query_string") or None)
        headers = route.upstream_headers(scope, port)
        host = _header(scope, b"host")
        if host and route.node:
            headers.append((b"Host", host.encode()))  # the node adds x-forwarded-host
        elif host:
            headers.append((b"x-forwarded-host", host.encode()))
        masked = route.upstream_host(port)
        if masked:
            # Spelled as E2B's proxy (Go) sends it: guests that read raw headers look for it.
            headers.append((b"Host", masked.encode()))
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        client = self._client(route)
        request = client.build_request(
            scope["method"], url, headers=headers,
            content=_request_body(receive) if has_body else None,
        )
        try:
            upstream = await client.send(request, stream=True)
        except httpx.HTTPError as e:
            if client.is_closed:  # forget() ran meanwhile: the sandbox stopped or moved
                log.info("sandbox %s: stopped before it answered %s", route.sandbox_id,
                         scope["path"])
            elif isinstance(e, httpx.ConnectError) and route.node is None:
                return await _answer(send, *port_closed(route.sandbox_id, port))
            else:
                log.info("sandbox %s: upstream failed before a response: %s",
                         route.sandbox_id, e)
            return await _answer(send, *not_found(route.sandbox_id))
        try:
            # Raw (still content-encoded) bytes are relayed, so the upstream length holds.
            out_headers = [(k, v) for k, v in upstream.headers.raw
                           if k.lower() not in _HOP_BY_HOP or k.lower() == b"content-length"]
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": out_headers})
            # uvicorn drops what is sent after the client went away without saying so: a
            # stream that never ends (a code-interpreter cell past the SDK's timeout, with
            # its keepalives) would keep the guest's connection, so the guest never saw
            # the client go. The request body is sent by now; receive() reports the end.
            gone = asyncio.ensure_future(_client_gone(receive))
            try:
                async for chunk in upstream.aiter_raw():
                    if gone.done():
                        return  # the finally closes the guest's connection
                    await send({"type": "http.response.body", "body": chunk,
                                "more_body": True})
            except (httpx.HTTPError, httpx.StreamError) as e:
                self._log_lost(route, client, upstream, e)
                return await _reset_client(send)
            finally:
                gone.cancel()
            await send({"type": "http.response.body", "body": b""})
        finally:
            await upstream.aclose()

    @staticmethod
    def _log_lost(route: Route, client: httpx.AsyncClient, upstream: httpx.Response,
                  error: Exception) -> None:
        """One line for an upstream that failed after the status line went out."""
        what = (f"{upstream.request.url.path} "
                f"({upstream.headers.get('content-type', '').split(';')[0] or 'no type'})")
        if client.is_closed:  # forget() ran: the sandbox stopped or moved
            log.info("sandbox %s: stopped while streaming %s; resetting the client's "
                     "connection", route.sandbox_id, what)
        else:
            log.warning("sandbox %s: upstream connection lost while streaming %s (%s: %s); "
                        "resetting the client's connection", route.sandbox_id, what,
                        type(error).__name__, error)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, route: Route,
                         port: int, path: bytes) -> None:
        query = scope.get("query_string", b"").decode("latin-1")
        # The connection goes to the guest (``sock``); the URI's authority is only what the
        # Host header says: the mask when the sandbox has one.
        ip, upstream_port = route.address(port)
        host = _header(scope, b"host") if route.node else None
        authority = host or route.upstream_host(port) or f"{ip}:{upstream_port}"
        tls = route.upstream_tls(port)
        uri = f"{'wss' if tls else 'ws'}://{authority}{path.decode('ascii')}" + \
            (f"?{query}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in route.upstream_headers(scope, port)
                   if not k.startswith(b"sec-websocket")]
        subprotocols = scope.get("subprotocols") or None
        try:
            # A socket of our own: marked as the server's (the host firewall asks for the
            # mark), and no proxy from the environment can capture it.
            sock = await connect_socket(ip, upstream_port, timeout=self.connect_timeout)
            upstream = await websockets.connect(
                uri, sock=sock, additional_headers=headers, subprotocols=subprotocols,
                open_timeout=self.connect_timeout, max_size=None,
                ssl=_UNVERIFIED if tls else None)
        except (TimeoutError, OSError, ssl.SSLError, websockets.InvalidHandshake):
            await send({"type": "websocket.close", "code": 1011})
            return
        live = self._websockets.setdefault(route.sandbox_id, set())
        live.add(upstream)
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def client_to_upstream() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    await upstream.close()
                    return
                if msg.get("bytes") is not None:
                    await upstream.send(msg["bytes"])
                elif msg.get("text") is not None:
                    await upstream.send(msg["text"])

        async def upstream_to_client() -> None:
            code = 1011
            try:
                async for data in upstream:
                    if isinstance(data, bytes):
                        await send({"type": "websocket.send", "bytes": data})
                    else:
                        await send({"type": "websocket.send", "text": data})
                code = upstream.close_code or 1000
            except websockets.ConnectionClosedError:
                log.info("sandbox %s: websocket to port %d lost (sandbox stopped or "
                         "connection reset)", route.sandbox_id, port)
            finally:
                # 1005 (no code) and 1006 (no close frame) are never sent on the wire.
                await send({"type": "websocket.close",
                            "code": {1005: 1000, 1006: 1011}.get(code, code)})

        tasks = [asyncio.create_task(client_to_upstream()),
                 asyncio.create_task(upstream_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            live.discard(upstream)
            if not live and self._websockets.get(route.sandbox_id) is live:
                del self._websockets[route.sandbox_id]
            await upstream.close()


async def _reset_client(send: Send) -> None:
    """End the response in progress with a TCP reset of the client's connection.

    ASGI cannot say "abort"; an app that returns before the body's end makes the server
    close the connection, which is a plain FIN. So the connection's socket is set to linger
    0 and its transport aborted (found through uvicorn's ``send``, a method of the request
    cycle that holds the transport). Yielding lets the server see the connection lost, so
    it does not log the incomplete response as its own error. Any other server: the
    early return alone, a close instead of a reset.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed
    transport.abort()
    # The server sees the connection lost one loop turn later over plain TCP, two over TLS
    # (the SSL protocol's own callback first): until then uvicorn would log the response
    # as incomplete ("ASGI callable returned without completing response").
    for _ in range(2):
        await asyncio.sleep(0)


async def _client_gone(receive: Receive) -> None:
    """Returns once the client has disconnected (what is left of a request body is read
    and dropped)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _request_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body = msg.get("body", b"")
        if body:
            yield body
        if not msg.get("more_body", False):
            return


def _header(scope: Scope, name: bytes) -> str | None:
    headers: Headers = scope["headers"]
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None
