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
for a sandbox.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any

import httpx

TLS_VERIFY_ENV = "AENV_TLS_VERIFY"


@functools.cache
def tls_verification() -> ssl.SSLContext | bool:
    """What ``verify=`` gets: a shared verifying context, or False when
    ``AENV_TLS_VERIFY`` is ``0``/``false``/``no``. Read once (``cache_clear`` to re-read)."""
    if os.environ.get(TLS_VERIFY_ENV, "").strip().lower() in ("0", "false", "no"):
        return False
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        return ssl.create_default_context(cafile=cafile or None, capath=capath or None)
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def plain_client(**options: Any) -> httpx.AsyncClient:
    options.setdefault("verify", tls_verification())
    return httpx.AsyncClient(trust_env=False, **options)
