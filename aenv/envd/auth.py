"""Access-token check in front of every envd route.

Once ``/init`` has set a token, a request must carry it in ``X-Access-Token``. ``/health``
stays open (the SDK's liveness probe), ``/init`` checks the token itself, and ``/files``
accepts a signed URL instead of the header, so it does its own check too.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import json_error
from .state import EnvdState

UNAUTHORIZED = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)

_OPEN = {("GET", "/health"), ("GET", "/files"), ("POST", "/files"), ("POST", "/init")}


class AccessTokenMiddleware:
    def __init__(self, app: ASGIApp, state: EnvdState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.state.access_token is None:
            return await self.app(scope, receive, send)
        if (scope["method"], scope["path"]) in _OPEN or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        token = header(scope, b"x-access-token")
        if not self.state.token_matches(token):
            return await json_error(401, UNAUTHORIZED)(scope, receive, send)
        await self.app(scope, receive, send)


def header(scope: Scope, name: bytes) -> str | None:
    """First value of a (lower-case) request header, decoded as latin-1."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
