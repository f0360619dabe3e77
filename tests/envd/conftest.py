"""envd on the host, driven by the real E2B SDK.

The SDK needs a control plane to create a sandbox. Until aenv's own server exists these
tests stand up ``FakeControlPlane`` (tests/fake_control_plane.py, shared with
tests/runtime): it answers the SDK's create/connect/kill calls with one fixed sandbox whose
envd is the one started here, and performs the ``/init`` the orchestrator would. Everything
the SDK then does goes to the real envd over ``E2B_SANDBOX_URL``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import Envd
from tests.fake_control_plane import FakeControlPlane


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


@pytest.fixture
def home_path() -> Iterator[str]:
    """A path under the sandbox user's home that does not exist yet; removed afterwards."""
    path = f"/home/user/aenv-t-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def home_dir(home_path: str) -> str:
    """Like ``home_path``, but the directory exists (made by root)."""
    os.mkdir(home_path)
    return home_path
