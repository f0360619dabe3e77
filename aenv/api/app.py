"""The REST application: FastAPI routes behind API-key auth and a body-size limit.

``create_api`` takes what the routes need (the orchestrator and a few read-only
collaborators) so the API can be served and tested without the rest of the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..orchestrator.service import Orchestrator
from . import errors, sandboxes, snapshots, templates
from .auth import ApiKeyMiddleware
from .errors import ApiError, error_response

MAX_BODY_BYTES = 1024 * 1024


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413 before a handler reads them."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["aenv.received"] = time.perf_counter()  # start of the "api" phase
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await error_response(413, "request body too large")(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    # Raised inside FastAPI's body parsing: its ApiError handler answers.
                    raise ApiError(413, "request body too large")
            return msg

        await self.app(scope, limited, send)


def create_api(
    orchestrator: Orchestrator,
    *,
    api_key: str,
    domain: str,
    metrics: Any,
    logs: Callable[..., list[dict[str, Any]]],
    builder: Any = None,
    upload_secret: bytes = b"",
    lifespan: Callable[[Any], Any] | None = None,
    extra_routers: tuple = (),
) -> ASGIApp:
    app = FastAPI(title="aenv", openapi_url="/openapi.json", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.orchestrator = orchestrator
    app.state.domain = domain
    app.state.metrics = metrics
    app.state.logs = logs
    app.state.builder = builder
    app.state.upload_secret = upload_secret
    errors.install(app)

    @app.get("/health", status_code=204)
    async def health() -> Response:
        return Response(status_code=204)

    @app.get("/metrics")
    async def prometheus(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(sandboxes.router)
    app.include_router(templates.router)
    app.include_router(snapshots.router)
    for router in extra_routers:
        app.include_router(router)
    return ApiKeyMiddleware(BodyLimit(app), api_key)
