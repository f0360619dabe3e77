"""envd on the host, driven by the real E2B SDK.

The SDK needs a control plane to create a sandbox. Until aenv's own server exists these
tests stand up ``FakeControlPlane``: it answers the SDK's create/connect/kill calls with
one fixed sandbox whose envd is the one started here, and performs the ``/init`` the
orchestrator would (access token, default user ``user``). Everything the SDK then does
goes to the real envd over ``E2B_SANDBOX_URL``.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.conftest import Envd, free_port, wait_http

SANDBOX_ID = "envdtestsandbox00001"


class FakeControlPlane:
    """Just enough of the REST API for ``Sandbox.create``/``connect``/``kill`` to succeed."""

    def __init__(self, envd: Envd, token: str | None) -> None:
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
        if token:
            init["accessToken"] = token
        httpx.post(envd.url + "/init", json=init).raise_for_status()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="session")
def envd(envd_factory) -> Envd:
    """The session's envd, initialised with an access token and default user ``user``."""
    return envd_factory("--default-user", "user")


@pytest.fixture(scope="session")
def access_token() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="session")
def control_plane(envd: Envd, access_token: str) -> Iterator[FakeControlPlane]:
    cp = FakeControlPlane(envd, access_token)
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def sdk_env(control_plane: FakeControlPlane) -> Iterator[dict[str, str]]:
    """Point the SDK at the fake control plane and the envd, by environment only."""
    env = {
        "E2B_API_KEY": "e2b_" + "0" * 40,
        "E2B_API_URL": control_plane.url,
        "E2B_SANDBOX_URL": control_plane.envd.url,
        "E2B_DOMAIN": "localhost",
    }
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    yield env
    mp.undo()


@pytest.fixture
def sandbox(sdk_env):
    from e2b import Sandbox

    sbx = Sandbox.create("base")
    yield sbx


@pytest.fixture
async def async_sandbox(sdk_env):
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create("base")
    yield sbx
