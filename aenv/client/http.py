"""The one way aenv makes an HTTP client for traffic to guests and local services.

Most of it is plain HTTP on addresses aenv owns (the proxy, the orchestrator's envd and
metrics calls), but the CLI's envd client goes to whatever ``--url`` says, which may be
``https://``. So TLS is verified, against certifi's CA bundle, or ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` when set (the way httpx reads them for the CLI's API client).
``AENV_TLS_VERIFY=0`` turns verification off, for a dev server with a self-signed
certificate. The SSL context is built once per process, on first use, and shared:
building one with the CA bundle costs ~16-20 ms of event-loop time, which every client
paid before.

The clients ignore proxy environment variables, which must never capture traffic meant
for a sandbox. The server's connections are marked as its own (``plain_client``).
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

import httpx

from ..config import ClientSettings


@functools.cache
def tls_verification() -> ssl.SSLContext | bool:
    """What ``verify=`` gets: a shared verifying context, or False when
    ``AENV_TLS_VERIFY`` (``ClientSettings.tls_verify``) is ``0``/``false``/``no``. Read
    once (``cache_clear`` to re-read)."""
    if not ClientSettings.from_env().tls_verify:
        return False
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        return ssl.create_default_context(cafile=cafile or None, capath=capath or None)
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def plain_client(**options: Any) -> httpx.AsyncClient:
    """An async client for guests and local services. As root (the server) its TCP
    connections carry ``network.access.SERVER_MARK``, which the host firewall asks of
    every new connection to a sandbox's host address when the pool is ``server_only``;
    other processes cannot set the mark, so they keep plain sockets."""
    verify = options.pop("verify", tls_verification())
    if os.geteuid() != 0:
        return httpx.AsyncClient(trust_env=False, verify=verify, **options)
    from ..network.access import sandbox_transport

    limits = options.pop("limits", httpx.Limits(max_connections=100,
                                                 max_keepalive_connections=20))
    return httpx.AsyncClient(trust_env=False, **options,
                             transport=sandbox_transport(verify=verify, limits=limits))
