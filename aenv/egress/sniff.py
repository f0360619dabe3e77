"""The destination name of a guest connection: the SNI of a TLS ClientHello, the Host of
an HTTP/1 request head. Pure parsing of bytes already read; no I/O.

Both return None when the bytes are complete but carry no name, and raise ``NeedMore``
when more bytes could still bring one (the caller reads on, up to ``MAX_HEAD``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_HEAD = 16 * 1024  # bytes read before giving up on finding a name


class NeedMore(Exception):
    pass


class NotParsable(Exception):
    """Not a TLS ClientHello / not an HTTP/1 request."""


def is_tls(data: bytes) -> bool:
    return len(data) >= 1 and data[0] == 0x16


def sni(data: bytes) -> str | None:
    """The server_name of the ClientHello at the start of ``data`` (one TLS record; a
    ClientHello split over records is refused as unparsable)."""
    if len(data) < 5:
        raise NeedMore
    ctype, _version, length = struct.unpack("!BHH", data[:5])
    if ctype != 0x16:
        raise NotParsable("not a TLS handshake record")
    if len(data) < 5 + length:
        raise NeedMore
    body = data[5:5 + length]
    try:
        if body[0] != 0x01:
            raise NotParsable("not a ClientHello")
        hello_len = int.from_bytes(body[1:4], "big")
        if hello_len + 4 > len(body):
            raise NotParsable("ClientHello spans records")
        p = 4 + 2 + 32  # version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p:p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        if p + 2 > 4 + hello_len:
            return None  # no extensions
        end = p + 2 + int.from_bytes(body[p:p + 2], "big")
        p += 2
        while p + 4 <= end:
            ext, elen = struct.unpack("!HH", body[p:p + 4])
            p += 4
            if ext == 0:  # server_name: list length, then (type, length, name)*
                q, qend = p + 2, p + elen
                while q + 3 <= qend:
                    kind, nlen = body[q], int.from_bytes(body[q + 1:q + 3], "big")
                    if kind == 0:
                        return body[q + 3:q + 3 + nlen].decode("ascii").lower()
                    q += 3 + nlen
                return None
            p += elen
    except (IndexError, UnicodeDecodeError) as e:
        raise NotParsable(f"malformed ClientHello: {e}") from None
    return None


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    size: int  # bytes of the head, blank line included

    @property
    def host(self) -> str | None:
        """The Host header's name, port and trailing dot dropped (lower case)."""
        for k, v in self.headers:
            if k.lower() == "host":
                name = v.strip().lower()
                if name.startswith("["):
                    return name.split("]")[0] + "]"
                return name.rsplit(":", 1)[0].rstrip(".") if ":" in name else name.rstrip(".")
        return None

    @property
    def target_host(self) -> str | None:
        """The host of an absolute-form target (``GET http://h/p``), which a server obeys
        rather than the Host header; None for the usual origin form."""
        t = self.target.lower()
        for scheme in ("http://", "https://"):
            if t.startswith(scheme):
                authority = t[len(scheme):].split("/", 1)[0].split("?", 1)[0]
                authority = authority.rsplit("@", 1)[-1]
                if authority.startswith("["):
                    return authority.split("]")[0] + "]"
                return authority.rsplit(":", 1)[0].rstrip(".")
        return None

    def render(self, set_headers: tuple[tuple[str, str], ...] = (),
               close: bool = False) -> bytes:
        """The head again, ``set_headers`` replacing those of the same name (case-blind),
        with ``Connection: close`` when ``close``."""
        drop = {k.lower() for k, _ in set_headers}
        if close:
            drop |= {"connection", "proxy-connection", "keep-alive"}
        lines = [f"{self.method} {self.target} {self.version}"]
        lines += [f"{k}: {v}" for k, v in self.headers if k.lower() not in drop]
        lines += [f"{k}: {v}" for k, v in set_headers]
        if close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def request_head(data: bytes) -> RequestHead:
    """The request line and headers at the start of ``data``."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) >= MAX_HEAD:
            raise NotParsable("request head too large")
        raise NeedMore
    text = data[:end].decode("latin-1")
    line, *rest = text.split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise NotParsable("not an HTTP/1 request line")
    headers = []
    for h in rest:
        name, sep, value = h.partition(":")
        if not sep or not name or name != name.strip():
            raise NotParsable(f"bad header line {h[:40]!r}")
        if any(c in value for c in "\r\n"):
            raise NotParsable("bad header value")
        headers.append((name, value.strip()))
    return RequestHead(parts[0], parts[1], parts[2], headers, end + 4)
