"""Which URLs a registry pull may use, and the HTTP clients it uses for them.

HTTPS, verified against certifi's public CAs plus ``AENV_REGISTRY_CA``, is the default
for every registry, token service and redirect target. Plain HTTP is allowed only for
loopback hosts (``localhost``, 127.0.0.0/8, ::1) and those named in
``AENV_INSECURE_REGISTRIES`` (``host`` or ``host:port``); such a registry is tried over
HTTPS first (an insecure one without certificate verification, as Docker does) and over
HTTP when that cannot connect. Proxy variables are ignored (``trust_env=False``) like
every aenv client; these connections go to registries, never to a sandbox, so they carry
no server socket mark (``network.access``).
"""

from __future__ import annotations

import functools
import ipaddress
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from ..config import Settings

CONNECT_TIMEOUT = 15.0
READ_TIMEOUT = 60.0


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split(hostport: str) -> tuple[str, str | None]:
    """(host, port or None) of ``host[:port]`` / ``[v6]:port``."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        return host.lower(), rest[1:] or None
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return hostport.lower(), None
    return host.lower(), port


class TransportPolicy:
    """The rules above for one settings object."""

    def __init__(self, settings: Settings) -> None:
        self.insecure = frozenset(
            e.strip().lower() for e in (settings.insecure_registries or "").split(",")
            if e.strip())
        self.ca = settings.registry_ca

    def insecure_host(self, hostport: str) -> bool:
        """Whether ``hostport`` is named in ``AENV_INSECURE_REGISTRIES``."""
        host, port = _split(hostport)
        return hostport.lower() in self.insecure or host in self.insecure or (
            port is not None and f"{host}:{port}" in self.insecure)

    def plain_http_allowed(self, hostport: str) -> bool:
        return is_loopback(_split(hostport)[0]) or self.insecure_host(hostport)

    def schemes(self, hostport: str) -> list[str]:
        """The schemes to try for a registry, in order."""
        return ["https", "http"] if self.plain_http_allowed(hostport) else ["https"]

    def url_allowed(self, url: str) -> bool:
        """Whether a URL the registry sent (token realm, redirect) may be fetched."""
        parts = urlsplit(url)
        if parts.scheme == "https":
            return bool(parts.netloc)
        return parts.scheme == "http" and self.plain_http_allowed(parts.netloc.rpartition("@")[2])

    def verify_for(self, hostport: str) -> ssl.SSLContext | bool:
        if self.insecure_host(hostport):
            return False
        return _verifying_context(self.ca)


@functools.cache
def _verifying_context(ca: Path | None) -> ssl.SSLContext:
    import certifi

    ctx = ssl.create_default_context(cafile=certifi.where())
    if ca is not None:
        ctx.load_verify_locations(cafile=str(ca))
    return ctx


def make_client(verify: ssl.SSLContext | bool,
                transport: httpx.BaseTransport | None = None) -> httpx.Client:
    """A client for registry traffic: no proxies, no automatic redirects (each hop is
    checked against the policy), bounded connect and read waits."""
    return httpx.Client(
        verify=verify, trust_env=False, follow_redirects=False, transport=transport,
        timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        headers={"User-Agent": "aenv-registry-client"})
