"""Assemble envd: control routes, ``/files``, and the two Connect-RPC services.

Connect paths (``/process.Process/*``, ``/filesystem.Filesystem/*``) go straight to their
connectrpc apps; everything else to Starlette. The access-token check wraps both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from . import control, files
from .auth import AccessTokenMiddleware
from .filesystem.service import FilesystemService
from .guest import GuestHooks
from .metrics import MetricsEndpoint, MetricsSampler
from .process.service import ProcessService
from .proto import filesystem_pb, process_pb
from .rpc import ConnectService
from .state import EnvdState

_CONNECT_EXPOSED = [
    "Connect-Protocol-Version",
    "Connect-Content-Encoding",
    "Connect-Accept-Encoding",
    "Grpc-Status",
    "Grpc-Message",
    "Location",
    "Cache-Control",
    "X-Content-Type-Options",
]


class _Dispatch:
    """Route by path prefix to the Connect apps, ``GET /metrics`` to ``metrics`` (what the
    orchestrator polls, without Starlette's layers), else to Starlette."""

    def __init__(self, web: ASGIApp, rpc: list[ConnectService],
                 metrics: ASGIApp | None = None) -> None:
        self.web = web
        self.rpc = {svc.path + "/": svc for svc in rpc}
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/metrics" and scope["method"] == "GET" and self.metrics is not None:
                return await self.metrics(scope, receive, send)
            for prefix, app in self.rpc.items():
                if path.startswith(prefix):
                    return await app(scope, receive, send)
        await self.web(scope, receive, send)


def create_app(state: EnvdState | None = None, hooks: GuestHooks | None = None,
               workload_cgroup: Path | None = None) -> ASGIApp:
    state = state or EnvdState()
    hooks = hooks or GuestHooks()
    process = ProcessService(state, workload_cgroup)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await process.shutdown()

    sampler = MetricsSampler()
    web = Starlette(routes=[*control.routes(state, hooks, sampler), *files.routes(state)],
                    lifespan=lifespan)
    app: ASGIApp = _Dispatch(
        web,
        [
            ConnectService(process, process_pb, "process.Process"),
            ConnectService(FilesystemService(state), filesystem_pb, "filesystem.Filesystem"),
        ],
        MetricsEndpoint(sampler),
    )
    app = AccessTokenMiddleware(app, state)
    return CORSMiddleware(
        app,
        allow_origins=["*"],
        allow_methods=["HEAD", "GET", "POST", "PUT", "PATCH", "DELETE"],
        allow_headers=["*"],
        expose_headers=_CONNECT_EXPOSED,
        max_age=7200,
    )
