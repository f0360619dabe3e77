"""Signed ``/files`` URLs and their expiration, at envd's ``/files`` routes (no VM).

E2B's envd accepts a signature without an expiration, and the SDK makes one whenever the
caller passes no ``use_signature_expiration``, so aenv accepts them by default too. With
``AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION=1`` envd refuses them (401), while signatures
with an expiration keep working until it passes.
"""

from __future__ import annotations

import getpass
import time
from pathlib import Path

import httpx
import pytest
from e2b.sandbox.signature import get_signature
from starlette.applications import Starlette

from aenv.envd import signing
from aenv.envd.files.routes import routes
from aenv.envd.state import EnvdState

TOKEN = "t0ken-for-signing-tests"


def _client(**kwargs) -> httpx.AsyncClient:
    state = EnvdState(access_token=TOKEN, default_user=getpass.getuser())
    app = Starlette(routes=routes(state, **kwargs))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd")


def _params(path: str, expires_in: int | None) -> dict[str, str]:
    sig = get_signature(path, "read", None, TOKEN, expires_in)
    params = {"path": path, "signature": sig["signature"]}
    if sig["expiration"] is not None:
        params["signature_expiration"] = str(sig["expiration"])
    return params


@pytest.fixture
def target(tmp_path: Path) -> str:
    f = tmp_path / "signed.txt"
    f.write_text("signed content")
    return str(f)


async def test_no_expiration_is_accepted_by_default_as_e2b_does(target) -> None:
    async with _client(require_signature_expiration=False) as c:
        r = await c.get("/files", params=_params(target, None))
    assert r.status_code == 200 and r.text == "signed content"


async def test_strict_envd_refuses_a_signature_without_expiration(target) -> None:
    async with _client(require_signature_expiration=True) as c:
        r = await c.get("/files", params=_params(target, None))
        assert r.status_code == 401
        assert r.json() == {"code": 401,
                            "message": "signature without expiration is not accepted"}
        ok = await c.get("/files", params=_params(target, 60))
        assert ok.status_code == 200 and ok.text == "signed content"
        expired = await c.get("/files", params=_params(target, -10))
        assert expired.json() == {"code": 401, "message": "signature is already expired"}


async def test_strict_envd_still_says_invalid_for_a_forged_signature(target) -> None:
    """The signature is checked first: a forger learns nothing about the policy."""
    params = {**_params(target, None), "signature": "v1_" + "A" * 43}
    async with _client(require_signature_expiration=True) as c:
        r = await c.get("/files", params=params)
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"


async def test_dropping_or_moving_the_expiration_invalidates_the_signature(target) -> None:
    params = _params(target, 60)
    async with _client(require_signature_expiration=False) as c:
        dropped = {k: v for k, v in params.items() if k != "signature_expiration"}
        assert (await c.get("/files", params=dropped)).json()["message"] == "invalid signature"
        moved = {**params, "signature_expiration": str(int(time.time()) + 10**9)}
        assert (await c.get("/files", params=moved)).json()["message"] == "invalid signature"


async def test_a_header_token_needs_no_signature_even_when_strict(target) -> None:
    async with _client(require_signature_expiration=True) as c:
        r = await c.get("/files", params={"path": target}, headers={"X-Access-Token": TOKEN})
    assert r.status_code == 200


@pytest.mark.parametrize(("value", "strict"), [("1", True), ("true", True), ("", False),
                                               ("0", False)])
async def test_the_policy_comes_from_the_environment_when_not_given(
        target, monkeypatch, value, strict) -> None:
    monkeypatch.setenv(signing.REQUIRE_EXPIRATION_ENV, value)
    async with _client() as c:
        r = await c.get("/files", params=_params(target, None))
    assert r.status_code == (401 if strict else 200)
