"""API-key authentication: ``X-API-KEY`` on every REST call except ``/health``, ``/metrics``.

The key is ``AENV_API_KEY`` when set, else read from (or generated into, mode 0600)
``AENV_HOME/secrets/api-key`` as ``e2b_`` + 40 hex digits, the form some SDK versions check.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

OPEN_PATHS = frozenset({"/health", "/metrics"})
# COPY archives are PUT by the SDK without an API key; that URL carries its own HMAC token.
_SIGNED_UPLOAD = re.compile(r"^/templates/[^/]+/files/[^/]+/upload$")


def load_api_key(secrets_dir: Path) -> tuple[str, Path | None]:
    """(key, file it lives in or None when it came from the environment)."""
    env = os.environ.get("AENV_API_KEY")
    if env:
        return env, None
    path = secrets_dir / "api-key"
    if path.exists():
        return path.read_text().strip(), path
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "e2b_" + secrets.token_hex(20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path in OPEN_PATHS or (scope["method"] == "PUT" and _SIGNED_UPLOAD.match(path)):
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k == b"x-api-key"]
        if len(given) != 1 or not hmac.compare_digest(given[0], self.key):
            msg = "missing API key (X-API-KEY)" if not given else "invalid API key"
            return await error_response(401, msg)(scope, receive, send)
        await self.app(scope, receive, send)
