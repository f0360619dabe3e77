"""A streaming ``multipart/form-data`` reader, and the header-parameter parser it needs.

Parts are read one after another straight from the request body: a part's data is handed
out in pieces as it arrives (only the last ``len(delimiter) - 1`` bytes are held back in
case a delimiter straddles two reads), so a part of any size takes a bounded amount of
memory. The part's ``filename`` is kept whole, directories included: without a ``path``
query parameter envd uses it as the target path (Go's ``Part.FileName()`` would strip
them). Malformed bodies raise ``MultipartError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import unquote

MAX_HEADER_BYTES = 64 * 1024
MAX_PREAMBLE_BYTES = 1 << 20


class MultipartError(ValueError):
    """The body is not well-formed multipart."""


def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """``'form-data; name="file"; filename="/a b.txt"'`` -> ``('form-data', {...})``.

    Like Go's ``mime.ParseMediaType``: parameter names lowercased, values a token or a
    quoted-string (backslash escapes undone, nothing else decoded), and RFC 2231
    ``name*=charset''percent-encoded`` values decoded.
    """
    kind, _, rest = value.partition(";")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while i < n:
        while i < n and rest[i] in " \t;":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        name = rest[i:eq].strip().lower()
        i = eq + 1
        while i < n and rest[i] in " \t":
            i += 1
        if i < n and rest[i] == '"':
            i += 1
            chars = []
            while i < n and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(rest[i])
                i += 1
            if i >= n:
                raise MultipartError(f"unterminated quoted parameter in {value!r}")
            i += 1
            param = "".join(chars)
        else:
            end = rest.find(";", i)
            end = n if end < 0 else end
            param = rest[i:end].strip()
            i = end
        if name.endswith("*"):
            charset, _, encoded = param.partition("'")
            _lang, _, encoded = encoded.partition("'")
            name = name[:-1]
            param = unquote(encoded, encoding=charset or "utf-8", errors="strict")
        if name:
            params[name] = param
    return kind.strip().lower(), params


class Part:
    """One part: its headers (lower-case names), form ``name`` and raw ``filename``."""

    def __init__(self, reader: MultipartReader, headers: dict[str, str]) -> None:
        self._reader = reader
        self.headers = headers
        _, params = parse_header_params(headers.get("content-disposition", ""))
        self.name = params.get("name")
        self.filename = params.get("filename")

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._reader._part_data()


class MultipartReader:
    def __init__(self, body: AsyncIterator[bytes], boundary: str) -> None:
        if not boundary:
            raise MultipartError("no multipart boundary param in Content-Type")
        self._body = body
        self._delimiter = b"\r\n--" + boundary.encode("latin-1")
        # Treat the very first boundary line like every later one: preceded by CRLF.
        self._buf = bytearray(b"\r\n")
        self._in_part = False
        self._done = False
        self._started = False

    async def _fill(self) -> bool:
        try:
            chunk = await anext(self._body)
        except StopAsyncIteration:
            return False
        self._buf += chunk
        return True

    async def next_part(self) -> Part | None:
        """The next part, after skipping what is left of the current one; None at the end."""
        if self._in_part:
            async for _ in self._part_data():
                pass
        if self._done:
            return None
        if not self._started:
            await self._skip_preamble()
            self._started = True
        while len(self._buf) < 2:
            if not await self._fill():
                raise MultipartError("multipart: unexpected end of body after a boundary")
        if self._buf.startswith(b"--"):
            self._done = True
            return None
        while True:
            start = len(self._buf) - len(self._buf.lstrip(b" \t"))
            end = self._buf.find(b"\r\n\r\n", start)
            if end >= 0:
                break
            if len(self._buf) > MAX_HEADER_BYTES:
                raise MultipartError("multipart: part headers too large")
            if not await self._fill():
                raise MultipartError("multipart: unexpected end of body in part headers")
        if not self._buf.startswith(b"\r\n", start):
            raise MultipartError("multipart: expected CRLF after boundary")
        headers = _parse_headers(bytes(self._buf[start + 2 : end]))
        del self._buf[: end + 4]
        self._in_part = True
        return Part(self, headers)

    async def _skip_preamble(self) -> None:
        while True:
            idx = self._buf.find(self._delimiter)
            if idx >= 0:
                del self._buf[: idx + len(self._delimiter)]
                return
            if len(self._buf) > MAX_PREAMBLE_BYTES:
                del self._buf[: -len(self._delimiter)]
            if not await self._fill():
                raise MultipartError("multipart: NextPart: EOF")

    async def _part_data(self) -> AsyncIterator[bytes]:
        if not self._in_part:
            return
        delimiter, keep = self._delimiter, len(self._delimiter) - 1
        while True:
            idx = self._buf.find(delimiter)
            if idx >= 0:
                if idx:
                    yield bytes(self._buf[:idx])
                del self._buf[: idx + len(delimiter)]
                self._in_part = False
                return
            if len(self._buf) > keep:
                piece = bytes(self._buf[:-keep])
                del self._buf[:-keep]
                yield piece
            if not await self._fill():
                raise MultipartError("multipart: unexpected end of body inside a part")


def _parse_headers(block: bytes) -> dict[str, str]:
    try:
        text = block.decode()
    except UnicodeDecodeError:
        raise MultipartError("multipart: part headers are not UTF-8") from None
    headers: dict[str, str] = {}
    last = None
    for line in text.split("\r\n"):
        if not line:
            continue
        if line[0] in " \t" and last is not None:  # obsolete line folding
            headers[last] += " " + line.strip()
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise MultipartError(f"multipart: malformed part header {line!r}")
        last = name.strip().lower()
        headers.setdefault(last, value.strip())
    return headers
