"""The real E2B SDK against aenv's API and proxy (sandboxes are host envd processes)."""

from __future__ import annotations

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery
from e2b.exceptions import AuthenticationException, SandboxException


def test_create_run_kill(api_env) -> None:
    sbx = Sandbox.create("base", metadata={"t": "lifecycle"})
    try:
        assert sbx.is_running()
        info = sbx.get_info()
        assert info.template_id == "base"
        assert info.metadata == {"t": "lifecycle"}
    finally:
        assert sbx.kill()
    assert not sbx.is_running()
    assert Sandbox.kill(sbx.sandbox_id) is False


async def test_async_create_and_list(api_env) -> None:
    a = await AsyncSandbox.create("base", metadata={"grp": "async-list"})
    b = await AsyncSandbox.create("base", metadata={"grp": "async-list"})
    try:
        paginator = AsyncSandbox.list(query=SandboxQuery(metadata={"grp": "async-list"}), limit=1)
        first = await paginator.next_items()
        assert len(first) == 1 and paginator.has_next
        second = await paginator.next_items()
        ids = {first[0].sandbox_id, second[0].sandbox_id}
        assert ids == {a.sandbox_id, b.sandbox_id}
        assert first[0].sandbox_id == b.sandbox_id  # newest first
    finally:
        await a.kill()
        await b.kill()


def test_unknown_template_is_404(api_env) -> None:
    with pytest.raises(SandboxException) as exc:
        Sandbox.create("no-such-template")
    assert "404" in str(exc.value) or "not found" in str(exc.value).lower()


def test_wrong_api_key(api_env, monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_" + "1" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.create("base")


def test_invalid_json_gets_e2b_error(server) -> None:
    r = httpx.post(server.url + "/v2/sandboxes", content=b"{nope",
                   headers={"X-API-KEY": server.server.api_key,
                            "Content-Type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()) == {"code", "message"} and r.json()["code"] == 400


def test_signed_urls_reach_their_sandbox_without_routing_headers(api_env) -> None:
    """The SDK's signed URLs carry no routing headers: the server finds the sandbox whose
    token produced the signature, and no other."""
    # These envds share the host's filesystem, so routing shows in the answer: the other
    # sandbox's envd would refuse a signature made with this one's token (401).
    other = Sandbox.create("base", secure=True)
    sbx = Sandbox.create("base", secure=True)
    try:
        up = sbx.upload_url("/home/user/signed.txt")
        r = httpx.post(up, files={"file": ("signed.txt", b"via a signed url")})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/home/user/signed.txt") == "via a signed url"
        down = httpx.get(sbx.download_url("/home/user/signed.txt"))
        assert down.status_code == 200 and down.content == b"via a signed url"
        forged = httpx.get(sbx.download_url("/home/user/signed.txt").replace(
            "signature=v1_", "signature=v1_0"))
        assert forged.status_code == 502, forged.text
    finally:
        sbx.kill()
        other.kill()
