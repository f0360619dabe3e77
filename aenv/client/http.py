"""The one way aenv makes an HTTP client for traffic to guests and local services.

All of it is plain HTTP on addresses aenv owns, so the client skips TLS set-up (building
an SSL context with the CA bundle costs ~16 ms of event-loop time per client) and ignores
proxy environment variables, which must never capture traffic meant for a sandbox.
"""

from __future__ import annotations

from typing import Any

import httpx


def plain_client(**options: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=False, trust_env=False, **options)
