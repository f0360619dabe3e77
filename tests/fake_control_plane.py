"""A fake E2B control plane for tests that drive one envd with the real SDK.

The SDK needs a control plane to create a sandbox. ``FakeControlPlane`` answers the SDK's
create/connect/kill calls with one fixed sandbox whose envd is the one given (anything with a
``url``: an envd on the host, or one inside a VM reached through its network slot), and
performs the ``/init`` the orchestrator would (access token, default user ``user``).
Everything the SDK then does goes to that envd over ``E2B_SANDBOX_URL`` / ``sandbox_url``.
Shared by tests/envd and tests/runtime.
"""

from __future__ import annotations

import threading
from typing import Protocol

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.conftest import free_port, wait_http

SANDBOX_ID = "envdtestsandbox00001"


class HasUrl(Protocol):
    url: str


class FakeControlPlane:
    """Just enough of the REST API for ``Sandbox.create``/``connect``/``kill`` to succeed."""

    def __init__(self, envd: HasUrl, token: str | None) -> None:
        self.envd, self.token = envd, token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        body = {
            "templateID": "base",
            "sandboxID": SANDBOX_ID,
            "clientID": "aenv-test",
            "envdVersion": "0.6.13",
            "envdAccessToken": token,
            "trafficAccessToken": None,
            "domain": "localhost",
        }

        async def create(_: Request) -> Response:
            return JSONResponse(body, status_code=201)

        async def connect(_: Request) -> Response:
            return JSONResponse(body, status_code=200)

        async def detail(_: Request) -> Response:
            return JSONResponse(
                {**body, "startedAt": "2026-01-01T00:00:00Z", "endAt": "2099-01-01T00:00:00Z",
                 "cpuCount": 2, "memoryMB": 512, "diskSizeMB": 1024, "state": "running"}
            )

        async def ok(_: Request) -> Response:
            return Response(status_code=204)

        app = Starlette(routes=[
            Route("/v2/sandboxes", create, methods=["POST"]),
            Route("/sandboxes", create, methods=["POST"]),
            Route("/v2/sandboxes/{sid}/connect", connect, methods=["POST"]),
            Route("/sandboxes/{sid}/connect", connect, methods=["POST"]),
            Route("/sandboxes/{sid}", detail, methods=["GET"]),
            Route("/sandboxes/{sid}", ok, methods=["DELETE"]),
            Route("/sandboxes/{sid}/timeout", ok, methods=["POST"]),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_http(self.url + "/sandboxes/x")
        init = {"defaultUser": "user", "envVars": {"E2B_SANDBOX": "true"}}
        headers = {}
        if token:
            init["accessToken"] = token
            headers["X-Access-Token"] = token  # a restored envd already holds this token
        httpx.post(envd.url + "/init", json=init, headers=headers).raise_for_status()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
