"""The REST application: FastAPI routes behind API-key auth and a body-size limit.

``create_api`` takes what the routes need (the orchestrator and a few read-only
collaborators) so the API can be served and tested without the rest of the server.
Request bodies are limited to 1 MiB, except COPY archive uploads (``PUT
/templates/{id}/files/{hash}/upload``), which stream to disk under ``upload_limit``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..orchestrator.service import Orchestrator
from ..store.secrets import LocalSecrets, SecretStore
from . import errors, sandboxes, secrets, snapshots, templates, volume_content, volumes
from .auth import ApiKeyMiddleware
from .errors import ApiError, error_response

MAX_BODY_BYTES = 1024 * 1024
UPLOAD_PATH = re.compile(r"^/templates/[^/]+/files/[^/]+/upload$")


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413 before a handler reads them.

    ``overrides`` are ``(method, path pattern, limit)``: the first that matches a request
    sets its limit instead.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES,
                 overrides: Sequence[tuple[str, re.Pattern[str], int]] = ()) -> None:
        self.app, self.limit, self.overrides = app, limit, tuple(overrides)

    def _limit(self, scope: Scope) -> int:
        for method, pattern, limit in self.overrides:
            if scope["method"] == method and pattern.match(scope["path"]):
                return limit
        return self.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["aenv.received"] = time.perf_counter()  # start of the "api" phase
        cap = self._limit(scope)
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > cap:
                return await error_response(413, "request body too large")(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > cap:
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
    upload_limit: int = templates.UPLOAD_LIMIT_BYTES,
    upload_link_ttl: float = templates.UPLOAD_LINK_TTL_S,
    lifespan: Callable[[Any], Any] | None = None,
    extra_routers: tuple[APIRouter, ...] = (),
    cluster_secret: str | None = None,
    secret_store: Any = None,
    volume_service: Any = None,
) -> ASGIApp:
    app = FastAPI(title="aenv", openapi_url="/openapi.json", docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.orchestrator = orchestrator
    app.state.domain = domain
    app.state.metrics = metrics
    app.state.logs = logs
    app.state.builder = builder
    app.state.upload_secret = upload_secret
    app.state.upload_limit = upload_limit
    app.state.upload_link_ttl = upload_link_ttl
    app.state.volumes = volume_service
    # None: /secrets answers 501. A node's own SecretStore is served through LocalSecrets.
    app.state.secrets = LocalSecrets(secret_store) if isinstance(secret_store, SecretStore) \
        else secret_store
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
    app.include_router(volumes.router)
    app.include_router(secrets.router)
    for router in extra_routers:
        app.include_router(router)
    limited = BodyLimit(app, overrides=[("PUT", UPLOAD_PATH, upload_limit)])
    outer = ApiKeyMiddleware(limited, api_key, cluster_secret)
    # The volume content API has its own auth, errors and body rules (volume_content).
    return volume_content.mount(outer, volume_service) if volume_service else outer
