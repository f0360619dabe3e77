"""E2B's Python and JavaScript SDKs' ``Secret`` against a real aenv server (host-process
sandboxes): every method of spec part 2 section 4.4, and the exceptions the SDKs raise
from our answers."""

from __future__ import annotations

import pytest
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException

from tests.conftest import ROOT, run_json_script


def test_secret_crud_through_the_sdk(api_env) -> None:
    info = Secret.create("SDK-Token", "s3cr3t-value", metadata={"owner": "tests"})
    try:
        assert info.name == "sdk-token" and info.version == 1
        assert info.secret_id.startswith("sec_") and info.metadata == {"owner": "tests"}
        assert "s3cr3t" not in repr(info)
        assert Secret.exists("sdk-token") and Secret.exists(info.secret_id)
        assert not Secret.exists("no-such-secret")
        with pytest.raises(SecretNotFoundException):
            Secret.get_info("no-such-secret")
        with pytest.raises(SecretException, match="409"):
            Secret.create("sdk-token", "again")
        updated = Secret.update("SDK-Token", "v2", metadata={"owner": "other"})
        assert updated.version == 2 and updated.metadata == {"owner": "other"}
        got = Secret.get_info(info.secret_id)
        assert (got.name, got.version, got.metadata) == ("sdk-token", 2, {"owner": "other"})
        more = [Secret.create(f"page-{i}", "x") for i in range(3)]
        paginator, names = Secret.list(limit=2), []
        while paginator.has_next:
            names += [s.name for s in paginator.next_items()]
        assert {"sdk-token", "page-0", "page-1", "page-2"} <= set(names)
        assert len(names) == len(set(names))
        for s in more:
            assert Secret.destroy(s.secret_id) is True
        assert Secret.fill("sdk-token") == "${e2b.secrets.sdk-token}"
    finally:
        assert Secret.destroy("sdk-token") is True
    assert Secret.destroy("sdk-token") is False
    with pytest.raises(SecretNotFoundException):
        Secret.update("sdk-token", "v3")


@pytest.mark.js
def test_secret_crud_through_the_js_sdk(api_env) -> None:
    out = run_json_script(["node", "secrets.mjs"], api_env, cwd=ROOT / "tests/js", timeout=120)
    assert "js-value-never-shown" not in str(out)
    made = out["made"]
    assert (made["name"], made["version"], made["metadata"]) == ("js-token", 1, {"k": "v"})
    assert made["secretId"].startswith("sec_")
    assert out["dup"][0] == "SecretError" and "409" in out["dup"][1]
    assert (out["updated"]["version"], out["updated"]["metadata"]) == (2, {})
    assert out["byId"]["name"] == "js-token" and out["byId"]["version"] == 2
    assert out["exists"] == [True, False]
    assert out["missing"][0] == "SecretNotFoundError"
    assert {"js-token", "js-page-0", "js-page-1", "js-page-2"} <= set(out["listed"])
    assert len(out["listed"]) == len(set(out["listed"]))
    assert out["fill"] == "${e2b.secrets.js-token}"
    assert out["destroyed"] == [True, False]
