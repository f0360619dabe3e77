"""The response of ``GET /files``: a regular file streamed from disk.

Identity responses behave like Go's ``http.ServeContent`` for what clients use: a single
``Range`` (206/416), ``If-Range``/``If-Modified-Since``/``If-Unmodified-Since`` by date,
``Last-Modified``, ``Accept-Ranges``, a type from the extension or a text/binary sniff.
A multi-range request gets the whole file (allowed by RFC 9110). gzip responses (chunked,
type from the extension) go through ``GzipEncoder``. Both carry
``Content-Disposition: inline; filename=<base name>`` and ``Vary: Accept-Encoding``; an
empty file is always identity with ``content-length: 0``.

Streaming: 1 MiB reads (and their gzip encoding) run in a worker thread, one read ahead of
the socket, so memory stays at a few MiB and the event loop never waits on the disk.
Zero-copy is not available: uvicorn implements neither the ASGI ``zerocopysend`` nor the
``pathsend`` extension and does not expose its transport, so ``os.sendfile`` cannot reach
the socket. A client that goes away stops the reads.
"""

from __future__ import annotations

import asyncio
import mimetypes
import os
import re
import stat
from email.utils import formatdate, parsedate_to_datetime

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from .encoding import GZIP, IDENTITY
from .errors import FilesHTTPError
from .gzip_stream import GzipEncoder

CHUNK = 1 << 20
_TOKEN = re.compile(r"\A[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BINARY = set(range(0x09)) | {0x0B} | set(range(0x0E, 0x1B)) | set(range(0x1C, 0x20))
_RANGE = re.compile(r"\A\s*(\d*)\s*-\s*(\d*)\s*\Z")


def content_disposition(filename: str) -> str:
    """``mime.FormatMediaType("inline", {"filename": name})`` as Go writes it."""
    if _TOKEN.match(filename):
        return f"inline; filename={filename}"
    if filename.isascii():
        escaped = filename.replace("\\", "\\\\").replace('"', '\\"')
        return f'inline; filename="{escaped}"'
    quoted = "".join(
        chr(b) if (b < 0x80 and chr(b).isalnum()) or chr(b) in "!#$&+-.^_`|~" else f"%{b:02X}"
        for b in filename.encode()
    )
    return f"inline; filename*=utf-8''{quoted}"


def type_by_extension(name: str) -> str | None:
    if not mimetypes.inited:
        # On first use, not at import: reading the system's type tables is ~30 ms of an
        # emulated guest's boot, and most sandboxes never download a file.
        mimetypes.init()
    ext = os.path.splitext(name)[1].lower()
    ctype = mimetypes.types_map.get(ext) if ext else None
    if ctype and ctype.startswith("text/") and "charset" not in ctype:
        ctype += "; charset=utf-8"
    return ctype


def _sniff(fd: int) -> str:
    head = os.pread(fd, 512, 0)
    if any(b in _BINARY for b in head):
        return "application/octet-stream"
    return "text/plain; charset=utf-8"


def _http_date(ts: float) -> str:
    return formatdate(int(ts), usegmt=True)


def _parse_date(value: str | None) -> int | None:
    if not value:
        return None
    try:
        return int(parsedate_to_datetime(value).timestamp())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _single_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end inclusive), None to ignore the header, or "unsatisfiable"."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    m = _RANGE.match(spec)
    if not m or m.group(1) == m.group(2) == "":
        return None
    first, last = m.group(1), m.group(2)
    if first == "":
        length = int(last)
        if length == 0 or size == 0:
            return "unsatisfiable"
        return max(size - length, 0), size - 1
    start = int(first)
    if start >= size:
        return "unsatisfiable"
    end = size - 1 if last == "" else min(int(last), size - 1)
    if end < start:
        return None
    return start, end


class FileDownload:
    """ASGI response that owns ``fd`` (closed when done) of an opened regular file."""

    def __init__(self, fd: int, st: os.stat_result, name_param: str, real_path: str,
                 coding: str, request: Headers, method: str) -> None:
        self.fd, self.st, self.method, self.request = fd, st, method, request
        self.size = st.st_size
        self.coding = GZIP if coding == GZIP and self.size > 0 else IDENTITY
        self.headers = {
            "content-disposition": content_disposition(os.path.basename(real_path)),
            "vary": "Accept-Encoding",
            "last-modified": _http_date(st.st_mtime),
        }
        self.name_param = name_param

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.coding == GZIP:
                self.headers["content-encoding"] = GZIP
                self.headers["content-type"] = (
                    type_by_extension(self.name_param) or "application/octet-stream"
                )
                await self._stream(send, receive, 200, 0, self.size, GzipEncoder())
            else:
                await self._identity(send, receive)
        finally:
            os.close(self.fd)

    async def _identity(self, send: Send, receive: Receive) -> None:
        mtime = int(self.st.st_mtime)
        unmodified_since = _parse_date(self.request.get("if-unmodified-since"))
        if unmodified_since is not None and mtime > unmodified_since:
            return await self._empty(send, 412)
        modified_since = _parse_date(self.request.get("if-modified-since"))
        if (modified_since is not None and "if-none-match" not in self.request
                and mtime <= modified_since):
            return await self._empty(send, 304)

        self.headers["accept-ranges"] = "bytes"
        self.headers["content-type"] = type_by_extension(self.name_param) or _sniff(self.fd)
        status, start, length = 200, 0, self.size
        range_header = self.request.get("range")
        if_range = self.request.get("if-range")
        if range_header and (if_range is None or if_range == self.headers["last-modified"]):
            wanted = _single_range(range_header, self.size)
            if wanted == "unsatisfiable":
                self.headers["content-range"] = f"bytes */{self.size}"
                body = b"invalid range: failed to overlap"
                self.headers["content-type"] = "text/plain; charset=utf-8"
                return await self._whole(send, 416, body)
            if wanted is not None:
                begin, end = wanted
                status, start, length = 206, begin, end - begin + 1
                self.headers["content-range"] = f"bytes {begin}-{end}/{self.size}"
        self.headers["content-length"] = str(length)
        await self._stream(send, receive, status, start, length, None)

    async def _empty(self, send: Send, status: int) -> None:
        headers = {k: v for k, v in self.headers.items() if k in ("last-modified", "vary")}
        await send({"type": "http.response.start", "status": status, "headers": _raw(headers)})
        await send({"type": "http.response.body", "body": b""})

    async def _whole(self, send: Send, status: int, body: bytes) -> None:
        self.headers["content-length"] = str(len(body))
        await send({"type": "http.response.start", "status": status, "headers": _raw(self.headers)})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Send, receive: Receive, status: int, start: int,
                      length: int, encoder: GzipEncoder | None) -> None:
        await send({"type": "http.response.start", "status": status, "headers": _raw(self.headers)})
        if self.method == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_wait_disconnect(receive, gone))
        fd = self.fd

        def work(offset: int, size: int) -> tuple[int, bytes]:
            data = os.pread(fd, size, offset)
            return len(data), encoder.encode(data) if encoder is not None and data else data

        try:
            offset, remaining = start, length
            pending = loop.run_in_executor(None, work, offset, min(CHUNK, remaining))
            while pending is not None:
                got, out = await pending
                if got == 0:
                    break  # the file shrank under us
                offset, remaining = offset + got, remaining - got
                pending = (
                    loop.run_in_executor(None, work, offset, min(CHUNK, remaining))
                    if remaining > 0 else None
                )
                if gone.is_set():
                    return
                await send({"type": "http.response.body", "body": out, "more_body": True})
            tail = encoder.finish() if encoder is not None else b""
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            watcher.cancel()


async def _wait_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1", "replace")) for k, v in headers.items()]


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open regular file ``path`` for reading; 404 when missing, 400 when not a file."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise FilesHTTPError(404, f"path '{path}' does not exist") from None
    except OSError as e:
        raise FilesHTTPError(500, f"error checking if path exists '{path}': {e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FilesHTTPError(400, f"path '{path}' is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise FilesHTTPError(400, f"path '{path}' is not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise FilesHTTPError(500, f"error opening file '{path}': {e}") from None
    return fd, os.fstat(fd)


def is_conditional(request: Headers) -> bool:
    """Range and conditional requests are answered in identity (as ServeContent needs)."""
    return any(h in request for h in ("range", "if-modified-since", "if-none-match", "if-range"))
