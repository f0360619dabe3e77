"""A lean HTTP/1.1 relay for the gateway's hop to a node (``Route.node``).

Why not httpx, as the node's own hop to a guest uses: a gateway adds a whole second proxy
hop to every sandbox request, and httpx's request and response objects, its connection
pool and its header models cost about 1-2 ms of a 2-core host's CPU per request, which is
most of what the gateway added (issue 18's goal: <= 1 ms on envd ``/health``). Here the
request head is written as bytes on a pooled keep-alive connection and the answer parsed
by httptools (the C parser uvicorn already uses), its body relayed chunk by chunk as it
arrives (streams such as ``commands.run`` stay streams).

Only what a node's listener needs: HTTP/1.1 over plain TCP, request bodies framed by
``Content-Length`` or chunked, responses framed by either or by the connection's end.
``HEAD`` and WebSocket upgrades stay with the router's other paths.

A keep-alive connection the node closed while it sat idle is found before reuse when the
close already arrived, and otherwise when the request fails before any answer: then a
request whose body is held whole (up to ``REPLAY_MAX``) is sent again once on a new
connection; a larger streamed body only ever goes on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httptools
from starlette.types import Receive, Send

Headers = list[tuple[bytes, bytes]]

REPLAY_MAX = 256 * 1024
IDLE_S = 60.0          # the node's listener keeps idle connections 300 s
MAX_IDLE = 32
READ_SIZE = 65536
_FRAMING = {b"content-length", b"transfer-encoding"}
_OUT_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
            b"te", b"trailer", b"transfer-encoding", b"upgrade"}


class UpstreamUnavailable(Exception):
    """Nothing was answered (connect, write or read failed before the status line): the
    caller may answer the client itself."""


class UpstreamLost(Exception):
    """The node's answer broke off after its status line went to the client."""


class _Answer:
    """httptools' callbacks: the status line, headers and body chunks as they parse."""

    __slots__ = ("chunks", "done", "framed", "head_done", "headers", "keep_alive", "parser")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.keep_alive = False  # read at the message's end: httptools forgets it after
        self.headers: Headers = []
        self.chunks: list[bytes] = []
        self.head_done = False
        self.done = False
        self.framed = False   # Content-Length or chunked: else the body ends with the connection

    def on_header(self, name: bytes, value: bytes) -> None:
        low = name.lower()
        if low in (b"content-length", b"transfer-encoding"):
            self.framed = True
        if low not in _OUT_HOP:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Relay:
    """Keep-alive connections to one node, and requests relayed over them."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0) -> None:
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self._idle: list[tuple[float, Connection]] = []
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, (_, writer) in idle:
            writer.close()

    def _reuse(self) -> Connection | None:
        now = time.monotonic()
        while self._idle:
            since, conn = self._idle.pop()
            reader, writer = conn
            if now - since < IDLE_S and not reader.at_eof() and not writer.is_closing():
                return conn
            writer.close()
        return None

    async def _connect(self) -> Connection:
        try:
            return await asyncio.wait_for(asyncio.open_connection(self.host, self.port),
                                          self.connect_timeout)
        except (OSError, TimeoutError) as e:
            raise UpstreamUnavailable(f"cannot connect to {self.host}:{self.port}: {e}") from e

    def _keep(self, conn: Connection) -> None:
        if self._closed or len(self._idle) >= MAX_IDLE:
            conn[1].close()
        else:
            self._idle.append((time.monotonic(), conn))

    async def relay(self, method: str, target: bytes, headers: Headers, body: BodySource,
                    send: Send) -> int:
        """Send the request, relay the answer to ``send`` as it comes.

        Returns the answer's status. Raises ``UpstreamUnavailable`` when no status line
        came (nothing was sent to the client), ``UpstreamLost`` when the answer broke off
        after it.
        """
        whole = await body.held()
        conn = self._reuse() if whole is not None else None
        if conn is not None:
            try:
                return await self._exchange(conn, method, target, headers, body, send)
            except UpstreamUnavailable:
                pass  # the idle connection was dead: once more on a new one
        return await self._exchange(await self._connect(), method, target, headers, body,
                                    send)

    async def _exchange(self, conn: Connection, method: str, target: bytes, headers: Headers,
                        body: BodySource, send: Send) -> int:
        reader, writer = conn
        keep = False
        try:
            try:
                head = [method.encode(), b" ", target, b" HTTP/1.1\r\n"]
                for k, v in headers:
                    if k.lower() not in _FRAMING:  # the body's own framing is added below
                        head += [k, b": ", v, b"\r\n"]
                head += body.framing()
                head.append(b"\r\n")
                writer.write(b"".join(head))
                await body.write_to(writer)
                await writer.drain()
            except (OSError, RuntimeError) as e:
                raise UpstreamUnavailable(f"request not sent: {e}") from e
            keep, status = await _answer(reader, send)
        finally:
            if keep:
                self._keep(conn)
            else:
                writer.close()
        return status


async def _answer(reader: asyncio.StreamReader, send: Send) -> tuple[bool, int]:
    """Relay one response; whether the connection may carry another request, and the
    response's status."""
    answer = _Answer()
    parser = answer.parser
    started = False
    while not answer.done:
        error: OSError | None = None
        try:
            data = await reader.read(READ_SIZE)
        except OSError as e:
            data, error = b"", e
        if not data:
            if answer.head_done and not answer.framed:
                break  # a body that ends with the connection
            if not started:
                raise UpstreamUnavailable(f"connection closed before an answer: {error}")
            raise UpstreamLost(f"connection closed mid-answer: {error}")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not started:
                raise UpstreamUnavailable(f"not an HTTP answer: {e}") from e
            raise UpstreamLost(f"bad answer: {e}") from e
        if answer.head_done and not started:
            await send({"type": "http.response.start", "status": parser.get_status_code(),
                        "headers": answer.headers})
            started = True
        chunks, answer.chunks = answer.chunks, []
        last = len(chunks) - 1 if answer.done else -1  # the end goes with the last chunk
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i != last})
        if answer.done and chunks:
            return answer.keep_alive, parser.get_status_code()
    await send({"type": "http.response.body", "body": b""})
    # An answer the parser saw end (framed, or bodiless: 204, 304) leaves the connection
    # reusable when HTTP says so; one that ended with the connection does not.
    return answer.done and answer.keep_alive, parser.get_status_code()


class BodySource:
    """A request's body from an ASGI ``receive``: none, one held whole (a known length up
    to ``REPLAY_MAX``, or a chunked one that ended within it: sent with its length, and
    again if need be), or a stream (a larger length, or chunked past ``REPLAY_MAX``: what
    was read ahead, then the rest)."""

    def __init__(self, receive: Receive, length: int | None, chunked: bool,
                 method: str) -> None:
        self.receive = receive
        self.length = length
        self.chunked = chunked and length is None
        self.method = method
        self._held: bytes | None = None
        self._ahead: list[bytes] = []   # a stream's start, read while trying to hold it
        self._read = False

    async def held(self) -> bytes | None:
        """The whole body when it is small enough to keep (b"" for none), else None."""
        if self._read:
            return self._held
        if self.length is None and not self.chunked:
            self._read, self._held = True, b""
        elif self.length is not None and self.length <= REPLAY_MAX:
            self._read, self._held = True, b"".join([c async for c in _chunks(self.receive)])
        elif self.chunked:
            size = 0
            while size <= REPLAY_MAX:
                msg = await self.receive()
                chunk = msg.get("body", b"") if msg["type"] != "http.disconnect" else b""
                self._ahead.append(chunk)
                size += len(chunk)
                if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                    self._read, self._held = True, b"".join(self._ahead)
                    self._ahead = []
                    break
        return self._held if self._read else None

    @property
    def replayable(self) -> bool:
        """Whether the body can be sent again (held whole, or none)."""
        return self._held is not None or not self._read

    def framing(self) -> list[bytes]:
        if self._held is not None:
            if self._held or self.method in ("POST", "PUT", "PATCH"):
                return [b"content-length: ", str(len(self._held)).encode(), b"\r\n"]
            return []
        if self.length is not None:
            return [b"content-length: ", str(self.length).encode(), b"\r\n"]
        return [b"transfer-encoding: chunked\r\n"]

    async def write_to(self, writer: asyncio.StreamWriter) -> None:
        if self._held is not None:
            if self._held:
                writer.write(self._held)
            return
        self._read = True  # streamed: cannot be sent again
        ahead, self._ahead = self._ahead, []

        async def stream() -> AsyncIterator[bytes]:
            for chunk in ahead:
                if chunk:
                    yield chunk
            async for chunk in _chunks(self.receive):
                yield chunk

        async for chunk in stream():
            if self.chunked:
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            else:
                writer.write(chunk)
            await writer.drain()
        if self.chunked:
            writer.write(b"0\r\n\r\n")


async def _chunks(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


def body_source(receive: Receive, headers: Headers, method: str) -> BodySource:
    """The request's body as its headers frame it."""
    length: int | None = None
    chunked = False
    for k, v in headers:
        if k == b"content-length":
            with contextlib.suppress(ValueError):
                length = int(v)
        elif k == b"transfer-encoding":
            chunked = True
    return BodySource(receive, length, chunked, method)

