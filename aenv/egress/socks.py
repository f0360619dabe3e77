"""A sandbox's own upstream proxy (E2B's ``network.egressProxy``): SOCKS5 (RFC 1928) with
optional username/password (RFC 1929), optionally over TLS to the proxy.

``SocksProxy`` is the validated option as a policy holds it (``from_option`` raises
ValueError with the field's name); ``open_tunnel`` dials the proxy, asks it to CONNECT to
a target and returns the stream, ready for the guest's bytes (or for TLS to the target).
The proxy's host is resolved again at every dial, and an address the node refuses (its
own, aenv's ranges, metadata: ``refused``) is never dialled. Every failure is ``Refused``:
the caller closes the guest's connection and never falls back to a direct one.

The target is a name (ATYP=domain, the proxy resolves it: what E2B does for flows an
``allowOut`` domain matched) or an IPv4 address (ATYP=IPv4). Only CONNECT is asked; UDP
ASSOCIATE is not (only TCP goes through the proxy).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_CREDENTIAL = 255  # RFC 1929: one length byte
MAX_SERVER_NAME = 253
MAX_CA_CERT = 8192
_VERSION = 5
_NO_AUTH, _USER_PASS, _NO_METHOD = 0x00, 0x02, 0xFF
_CONNECT = 1
_ATYP_IPV4, _ATYP_DOMAIN, _ATYP_IPV6 = 1, 3, 4
_REPLIES = {1: "general failure", 2: "not allowed by ruleset", 3: "network unreachable",
            4: "host unreachable", 5: "connection refused", 6: "TTL expired",
            7: "command not supported", 8: "address type not supported"}


class SocksError(Exception):
    """The proxy could not be reached, refused us, or answered nonsense."""


@dataclass(frozen=True)
class SocksProxy:
    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False
    server_name: str | None = None
    ca_cert: str | None = None  # PEM; replaces the system's CAs

    @classmethod
    def from_option(cls, raw: Mapping[str, Any]) -> SocksProxy:
        """``egressProxy`` as E2B's API takes it; raises ValueError naming the field."""
        address = raw.get("address")
        if not isinstance(address, str) or not address:
            raise ValueError("address is required (host:port)")
        host, sep, port_text = address.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"address {address!r} is not host:port")
        if any(c.isspace() or c in "/@" for c in host):
            raise ValueError(f"address {address!r} is not host:port")
        username, password = raw.get("username"), raw.get("password")
        for key, value in (("username", username), ("password", password)):
            if value is not None and (not isinstance(value, str) or
                                      len(value.encode()) > MAX_CREDENTIAL):
                raise ValueError(f"{key} is a string of at most {MAX_CREDENTIAL} bytes")
        if password is not None and username is None:
            raise ValueError("password without username")
        tls, server_name, ca_cert = raw.get("tls"), None, None
        if tls is not None:
            if not isinstance(tls, Mapping) or not isinstance(tls.get("enabled"), bool):
                raise ValueError("tls is {\"enabled\": bool, \"serverName\"?, \"caCert\"?}")
            server_name, ca_cert = tls.get("serverName"), tls.get("caCert")
            if not tls["enabled"] and (server_name is not None or ca_cert is not None):
                raise ValueError("tls: no other field with enabled false")
            if server_name is not None and (not isinstance(server_name, str) or
                                            not 0 < len(server_name) <= MAX_SERVER_NAME):
                raise ValueError(f"tls.serverName is at most {MAX_SERVER_NAME} characters")
            if ca_cert is not None:
                if not isinstance(ca_cert, str) or len(ca_cert.encode()) > MAX_CA_CERT:
                    raise ValueError(f"tls.caCert is PEM of at most {MAX_CA_CERT} bytes")
                try:
                    ssl.create_default_context(cadata=ca_cert)
                except (ssl.SSLError, ValueError):
                    raise ValueError("tls.caCert is not a PEM certificate") from None
            tls = tls["enabled"]
        return cls(host, int(port_text), username, password, bool(tls), server_name, ca_cert)

    def public(self) -> dict[str, Any]:
        """What ``GET /sandboxes/{id}`` shows: never the password or the CA."""
        out: dict[str, Any] = {"address": f"{self.host}:{self.port}"}
        if self.username is not None:
            out["username"] = self.username
        if self.tls:
            out["tls"] = {"enabled": True, **({"serverName": self.server_name}
                                                if self.server_name else {})}
        return out

    def tls_context(self) -> ssl.SSLContext:
        """Verified always (TLS 1.2 or later); ``ca_cert`` replaces the system's CAs."""
        ctx = ssl.create_default_context(cadata=self.ca_cert) if self.ca_cert else \
            ssl.create_default_context()
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def public_option(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A stored ``egressProxy`` as it is read back (None stays None)."""
    return None if raw is None else SocksProxy.from_option(raw).public()


async def open_tunnel(proxy: SocksProxy, target: str, port: int, *,
                      refused: Callable[[str], bool] = lambda _ip: False,
                      timeout: float = 10.0
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream through ``proxy`` to ``target`` (a name: ATYP=domain; an IPv4 address:
    ATYP=IPv4) and ``port``. Raises SocksError."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await _dial(proxy, refused)
            try:
                await _handshake(proxy, reader, writer, target, port)
            except BaseException:
                writer.close()
                raise
            return reader, writer
    except TimeoutError:
        raise SocksError(f"proxy {proxy.host}:{proxy.port} timed out") from None
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
        raise SocksError(f"proxy {proxy.host}:{proxy.port}: {type(e).__name__}: {e}") from None


async def _dial(proxy: SocksProxy, refused: Callable[[str], bool]
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(proxy.host, proxy.port, family=socket.AF_INET,
                                       type=socket.SOCK_STREAM)
    except OSError:
        raise SocksError(f"proxy {proxy.host} does not resolve") from None
    addresses = [str(i[4][0]) for i in infos if not refused(str(i[4][0]))]
    if not addresses:
        raise SocksError(f"proxy {proxy.host}: no address the node may dial")
    tls = proxy.tls_context() if proxy.tls else None
    last: Exception = SocksError("no address")
    for address in dict.fromkeys(addresses):
        try:
            return await asyncio.open_connection(
                address, proxy.port, ssl=tls,
                server_hostname=(proxy.server_name or proxy.host) if tls else None)
        except (OSError, ssl.SSLError) as e:
            last = e
    raise SocksError(f"proxy {proxy.host}:{proxy.port} unreachable: {last}")


async def _handshake(proxy: SocksProxy, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, target: str, port: int) -> None:
    methods = bytes([_NO_AUTH, _USER_PASS]) if proxy.username is not None else bytes([_NO_AUTH])
    writer.write(bytes([_VERSION, len(methods)]) + methods)
    await writer.drain()
    version, method = await reader.readexactly(2)
    if version != _VERSION or method not in methods:
        raise SocksError("the proxy accepts none of our authentication methods")
    if method == _USER_PASS:
        user = (proxy.username or "").encode()
        password = (proxy.password or "").encode()
        writer.write(bytes([1, len(user)]) + user + bytes([len(password)]) + password)
        await writer.drain()
        _, status = await reader.readexactly(2)
        if status != 0:
            raise SocksError("the proxy refused the username and password")
    try:
        address = bytes([_ATYP_IPV4]) + ipaddress.IPv4Address(target).packed
    except ValueError:
        name = target.encode("idna")
        if not 0 < len(name) <= 255:
            raise SocksError(f"{target}: not a name SOCKS can carry") from None
        address = bytes([_ATYP_DOMAIN, len(name)]) + name
    writer.write(bytes([_VERSION, _CONNECT, 0]) + address + struct.pack("!H", port))
    await writer.drain()
    version, reply, _, atyp = await reader.readexactly(4)
    if version != _VERSION:
        raise SocksError("not a SOCKS5 answer")
    if reply != 0:
        raise SocksError(f"the proxy could not connect to {target}:{port}: "
                         f"{_REPLIES.get(reply, f'reply {reply}')}")
    if atyp == _ATYP_IPV4:
        await reader.readexactly(4 + 2)
    elif atyp == _ATYP_IPV6:
        await reader.readexactly(16 + 2)
    elif atyp == _ATYP_DOMAIN:
        await reader.readexactly((await reader.readexactly(1))[0] + 2)
    else:
        raise SocksError(f"bound address of unknown type {atyp}")


__all__ = ["SocksError", "SocksProxy", "open_tunnel", "public_option"]
