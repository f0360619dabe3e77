"""The response of ``GET /files``: a regular file streamed from disk.

Identity responses behave like Go's ``http.ServeContent`` for what clients use: a single
``Range`` (206/416), ``If-Range``/``If-Modified-Since``/``If-Unmodified-Since`` by date,
``Last-Modified``, ``Accept-Ranges``, a type from the extension or a text/binary sniff.
A multi-range request gets the whole file (allowed by RFC 9110). gzip responses (chunked,
type from the extension) go through ``GzipEncoder``. Both carry
``Content-Disposition: inline; filename=<base name>`` and ``Vary: Accept-Encoding``; an
empty file is always identity with ``content-length: 0``.

Pseudo-files: a regular file whose ``st_size`` is 0 (``/proc``, ``/sys``, some FUSE files)
may still have content, so size 0 means "unknown", not "empty". Its first read (up to one
chunk) happens before the headers: nothing there is an empty file as above; content that
ended within it is sent with its ``Content-Length``; longer content is sent chunked, read
to EOF. Such content is generated on each read, so a pseudo-file gets no ``Last-Modified``,
no conditionals and no ranges (``Accept-Ranges: none``; a Range gets the whole 200). Reads
are sequential (many pseudo-files refuse ``pread``), non-blocking (a file that would wait
for data, like ``/proc/kmsg``, ends where its data does), capped at ``UNKNOWN_SIZE_LIMIT``
(past it, and on a read error once the headers are out, the response is left incomplete so
the client sees a failure, never a short body that looks whole), and run in their own few
threads so a read the kernel still blocks cannot starve the shared pool. Devices, FIFOs and
sockets are refused with a 400 (the E2B contract: the file must be regular): a character
device such as ``/dev/urandom`` never ends, and a FIFO waits for a writer.

Streaming: 1 MiB reads (and their gzip encoding) run in a worker thread, one read ahead of
the socket, so memory stays at a few MiB and the event loop never waits on the disk.
Zero-copy is not available: uvicorn implements neither the ASGI ``zerocopysend`` nor the
``pathsend`` extension and does not expose its transport, so ``os.sendfile`` cannot reach
the socket. A client that goes away stops the reads.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import os
import re
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from email.utils import formatdate, parsedate_to_datetime
from typing import Literal

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from ..errors import json_error
from .encoding import GZIP
from .errors import FilesHTTPError
from .gzip_stream import GzipEncoder

log = logging.getLogger("aenv.envd.files")

CHUNK = 1 << 20
# Far above what the kernel's honest pseudo-files hold (kallsyms is a few MiB); what goes
# past it (``/proc/<pid>/pagemap`` spans the whole address space) is not a file to download.
UNKNOWN_SIZE_LIMIT = 256 << 20
_PSEUDO_READERS = 4
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


def _sniff(head: bytes) -> str:
    if any(b in _BINARY for b in head[:512]):
        return "application/octet-stream"
    return "text/plain; charset=utf-8"


_pseudo_pool: ThreadPoolExecutor | None = None


def _pseudo_executor() -> ThreadPoolExecutor:
    global _pseudo_pool
    if _pseudo_pool is None:
        _pseudo_pool = ThreadPoolExecutor(_PSEUDO_READERS, thread_name_prefix="envd-pseudo-read")
    return _pseudo_pool


def _read_some(fd: int, size: int) -> bytes:
    """One sequential read; b"" at EOF, and where a non-blocking file has nothing now."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return b""


def _read_head(fd: int, size: int) -> tuple[bytes, bool]:
    """Up to ``size`` bytes from the start, and whether EOF came within them."""
    parts: list[bytes] = []
    got = 0
    while got < size:
        data = _read_some(fd, size - got)
        if not data:
            return b"".join(parts), True
        parts.append(data)
        got += len(data)
    return b"".join(parts), False


def _http_date(ts: float) -> str:
    return formatdate(int(ts), usegmt=True)


def _parse_date(value: str | None) -> int | None:
    if not value:
        return None
    try:
        return int(parsedate_to_datetime(value).timestamp())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _single_range(header: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
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
        self.coding = coding
        self.real_path = real_path
        self.headers = {
            "content-disposition": content_disposition(os.path.basename(real_path)),
            "vary": "Accept-Encoding",
        }
        self.name_param = name_param
        # a read still running in a worker: (bytes read, bytes to send, more may follow)
        self._inflight: asyncio.Future[tuple[int, bytes, bool]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.size == 0:
                await self._unknown_size(scope, send, receive)
                return
            self.headers["last-modified"] = _http_date(self.st.st_mtime)
            if self.coding == GZIP:
                await self._gzip(send, receive, self._pread_chunks(0, self.size))
            else:
                await self._identity(send, receive)
        finally:
            self._close_after_inflight()

    def _close_after_inflight(self) -> None:
        """Close ``fd`` once no worker reads it: a read on a closed, reused descriptor
        number could take bytes from whatever (a socket) got that number next."""
        fd, inflight = self.fd, self._inflight
        if inflight is None or inflight.done():
            os.close(fd)
            return

        def close(f: asyncio.Future[tuple[int, bytes, bool]]) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: a late read error is of no interest now
            os.close(fd)

        inflight.add_done_callback(close)

    async def _unknown_size(self, scope: Scope, send: Send, receive: Receive) -> None:
        loop = asyncio.get_running_loop()
        try:
            head, eof = await loop.run_in_executor(_pseudo_executor(), _read_head, self.fd, CHUNK)
        except OSError as e:
            response = json_error(500, f"error reading file '{self.real_path}': {e}")
            return await response(scope, receive, send)
        if not head:  # an empty file (or one with nothing to give now): what size 0 says
            self.headers["last-modified"] = _http_date(self.st.st_mtime)
            self.size = 0
            return await self._identity(send, receive, head)
        self.headers["accept-ranges"] = "none"
        fd, pending = self.fd, [head]

        def chunks() -> tuple[bytes, bool]:
            if pending:
                return pending.pop(), not eof
            data = _read_some(fd, CHUNK)
            return data, bool(data)

        if self.coding == GZIP:
            return await self._gzip(send, receive, chunks, pseudo=True)
        self.headers["content-type"] = type_by_extension(self.name_param) or _sniff(head)
        if eof:
            self.headers["content-length"] = str(len(head))
        await self._stream(send, receive, 200, chunks, None, pseudo=True)

    async def _gzip(self, send: Send, receive: Receive, chunks: Callable[[], tuple[bytes, bool]],
                    pseudo: bool = False) -> None:
        self.headers["content-encoding"] = GZIP
        ctype = type_by_extension(self.name_param) or "application/octet-stream"
        self.headers["content-type"] = ctype
        await self._stream(send, receive, 200, chunks, GzipEncoder(), pseudo=pseudo)

    def _pread_chunks(self, start: int, length: int) -> Callable[[], tuple[bytes, bool]]:
        """Reads of ``length`` bytes from ``start``, one CHUNK per call, with "more to come"."""
        fd, offset, remaining = self.fd, start, length

        def chunks() -> tuple[bytes, bool]:
            nonlocal offset, remaining
            data = os.pread(fd, min(CHUNK, remaining), offset)
            offset, remaining = offset + len(data), remaining - len(data)
            return data, remaining > 0

        return chunks

    async def _identity(self, send: Send, receive: Receive, head: bytes | None = None) -> None:
        mtime = int(self.st.st_mtime)
        unmodified_since = _parse_date(self.request.get("if-unmodified-since"))
        if unmodified_since is not None and mtime > unmodified_since:
            return await self._empty(send, 412)
        modified_since = _parse_date(self.request.get("if-modified-since"))
        if (modified_since is not None and "if-none-match" not in self.request
                and mtime <= modified_since):
            return await self._empty(send, 304)

        self.headers["accept-ranges"] = "bytes"
        if head is None:
            head = os.pread(self.fd, 512, 0)
        self.headers["content-type"] = type_by_extension(self.name_param) or _sniff(head)
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
        await self._stream(send, receive, status, self._pread_chunks(start, length), None)

    async def _empty(self, send: Send, status: int) -> None:
        headers = {k: v for k, v in self.headers.items() if k in ("last-modified", "vary")}
        await send({"type": "http.response.start", "status": status, "headers": _raw(headers)})
        await send({"type": "http.response.body", "body": b""})

    async def _whole(self, send: Send, status: int, body: bytes) -> None:
        self.headers["content-length"] = str(len(body))
        await send({"type": "http.response.start", "status": status, "headers": _raw(self.headers)})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send: Send, receive: Receive, status: int,
                      chunks: Callable[[], tuple[bytes, bool]], encoder: GzipEncoder | None,
                      pseudo: bool = False) -> None:
        """Send ``chunks()`` (data, more-may-follow) until it runs out; pseudo-files read in
        their own threads and under ``UNKNOWN_SIZE_LIMIT``. Returning before the final
        (``more_body: False``) message leaves the response incomplete on purpose."""
        await send({"type": "http.response.start", "status": status, "headers": _raw(self.headers)})
        if self.method == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_wait_disconnect(receive, gone))
        executor = _pseudo_executor() if pseudo else None
        limit = UNKNOWN_SIZE_LIMIT if pseudo else None

        def work() -> tuple[int, bytes, bool]:
            data, more = chunks()
            return len(data), encoder.encode(data) if encoder is not None and data else data, more

        try:
            total = 0
            pending: asyncio.Future[tuple[int, bytes, bool]] | None
            pending = self._inflight = loop.run_in_executor(executor, work)
            while pending is not None:
                try:
                    got, out, more = await pending
                except OSError as e:
                    log.warning("read of %s failed mid-response: %s", self.real_path, e)
                    return
                if got == 0:
                    break  # the file shrank under us, or a pseudo-file ended
                total += got
                if limit is not None and total > limit:
                    log.warning("%s is past %d bytes; response cut off", self.real_path, limit)
                    return
                pending = self._inflight = loop.run_in_executor(executor, work) if more else None
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
        # O_NONBLOCK: if the path became a FIFO since the stat, the open does not wait for
        # a writer; pseudo-files keep it so their reads do not wait for data either.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise FilesHTTPError(500, f"error opening file '{path}': {e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FilesHTTPError(400, f"path '{path}' is not a regular file")
    if st.st_size > 0:
        os.set_blocking(fd, True)
    return fd, st


def is_conditional(request: Headers) -> bool:
    """Range and conditional requests are answered in identity (as ServeContent needs)."""
    return any(h in request for h in ("range", "if-modified-since", "if-none-match", "if-range"))
