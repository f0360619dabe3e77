"""Secrets through the real REST app and store (spec part 2, section 4.4), without a host.

Shown: the wire of the five routes, lower-cased unique names, versions, metadata limits,
pagination with ``X-Next-Token``, E2B-shaped errors, that no answer ever carries a value,
and that the database holds the value only sealed under the node key (0600, made once).
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.orchestrator.metrics import MetricsCollector
from aenv.orchestrator.service import Orchestrator
from aenv.store import Database, SandboxStore, TemplateStore
from aenv.store.secret_box import KEY_FILE, SecretBox, SecretKeyError, load_key
from aenv.store.secrets import SecretStore
from tests.api.api_world import AUTH, KEY
from tests.orchestrator.test_orchestrator import FakeMachines

VALUE = "sk-live-0123456789-never-shown"


@pytest.fixture
def world(tmp_path: Path):
    db = Database(tmp_path / "aenv.db")
    sandboxes, templates = SandboxStore(db), TemplateStore(db)
    store = SecretStore(db, SecretBox(load_key(tmp_path / "secrets")))
    app = create_api(Orchestrator(sandboxes, templates, FakeMachines()), api_key=KEY,
                     domain="localhost", metrics=MetricsCollector(sandboxes),
                     logs=lambda *a, **k: [], secret_store=store)
    yield app, store, tmp_path
    db.close()


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.request(method, path, headers=AUTH, **kw)
    r = asyncio.run(go())
    assert VALUE not in r.text  # no answer ever carries a value
    return r


def test_create_get_update_delete(world) -> None:
    app, store, _ = world
    r = call(app, "POST", "/secrets", json={"name": "My-Key", "value": VALUE,
                                            "metadata": {"team": "a"}})
    assert r.status_code == 201, r.text
    sec = r.json()
    assert set(sec) == {"secretID", "name", "currentVersion", "metadata", "createdAt",
                        "updatedAt"}
    assert sec["name"] == "my-key" and sec["currentVersion"] == 1
    assert sec["secretID"].startswith("sec_") and sec["metadata"] == {"team": "a"}
    for ref in (sec["secretID"], "my-key", "MY-KEY"):
        assert call(app, "GET", f"/secrets/{ref}").json() == sec
    r = call(app, "POST", "/secrets/my-key", json={"value": VALUE + "2"})
    assert r.status_code == 200 and r.json()["currentVersion"] == 2
    assert r.json()["metadata"] == {"team": "a"}  # kept when not given
    r = call(app, "POST", f"/secrets/{sec['secretID']}", json={"value": "v3", "metadata": {}})
    assert r.json()["currentVersion"] == 3 and r.json()["metadata"] == {}
    assert store.value("my-key") == "v3"
    assert call(app, "DELETE", "/secrets/my-key").status_code == 204
    r = call(app, "GET", "/secrets/my-key")
    assert r.status_code == 404 and r.json()["code"] == 404
    assert call(app, "DELETE", "/secrets/my-key").status_code == 404
    assert call(app, "POST", "/secrets/my-key", json={"value": "x"}).status_code == 404
    assert store.value("my-key") is None


def test_names_are_unique_case_blind(world) -> None:
    app, _, _ = world
    assert call(app, "POST", "/secrets", json={"name": "dup", "value": "a"}).status_code == 201
    r = call(app, "POST", "/secrets", json={"name": "DUP", "value": "b"})
    assert r.status_code == 409 and r.json() == {"code": 409, "message": r.json()["message"]}


@pytest.mark.parametrize("body, words", [
    ({"name": "", "value": "v"}, "1 to"),
    ({"name": "a{b}", "value": "v"}, "may not contain"),
    ({"name": "a\nb", "value": "v"}, "may not contain"),
    ({"name": "sec_x", "value": "v"}, "kept for ids"),
    ({"name": "n", "value": "v", "metadata": {str(i): "x" for i in range(33)}}, "32"),
    ({"name": "n", "value": "v", "metadata": {"k" * 129: "x"}}, "128"),
    ({"name": "n", "value": "v", "metadata": {"k": "x" * 1025}}, "1024"),
    ({"name": "n", "value": "v", "metadata": {f"k{i}": "x" * 1000 for i in range(9)}}, "8192"),
    ({"name": "n", "value": "v" * (64 * 1024 + 1)}, "larger"),
    ({"name": "n"}, "value"),
    ({"name": 3, "value": "v"}, "name"),
    ({"name": "n", "value": "v", "metadata": {"k": 1}}, "metadata"),
])
def test_bad_requests_are_400_with_a_reason(world, body, words) -> None:
    r = call(world[0], "POST", "/secrets", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == 400 and words in r.json()["message"]


def test_list_pages_with_next_token(world) -> None:
    app, _, _ = world
    made = [call(app, "POST", "/secrets", json={"name": f"s{i}", "value": VALUE}).json()
            for i in range(5)]
    seen, token = [], None
    while True:
        r = call(app, "GET", "/secrets", params={"limit": 2, **({"nextToken": token}
                                                                 if token else {})})
        assert r.status_code == 200
        seen += r.json()
        token = r.headers.get("x-next-token")
        if not token:
            break
    assert [s["secretID"] for s in seen] == [s["secretID"] for s in made]
    assert call(app, "GET", "/secrets", params={"limit": 0}).status_code == 400
    assert call(app, "GET", "/secrets", params={"nextToken": "%%"}).status_code == 400


def test_values_are_sealed_at_rest_under_a_0600_key(world) -> None:
    app, store, home = world
    call(app, "POST", "/secrets", json={"name": "k", "value": VALUE})
    key_file = home / "secrets" / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert load_key(home / "secrets") == key_file.read_bytes()  # made once, then read
    raw = b"".join(p.read_bytes() for p in home.glob("aenv.db*"))
    assert VALUE.encode() not in raw
    assert store.value("k") == VALUE
    other = SecretStore(store.db, SecretBox(os.urandom(32)))  # another node's key
    with pytest.raises(SecretKeyError):
        other.value("k")


def test_a_sealed_value_opens_only_for_its_own_secret_and_version() -> None:
    box = SecretBox(os.urandom(32))
    sealed = box.seal("v", "sec_a:1")
    assert box.open(sealed, "sec_a:1") == "v"
    with pytest.raises(SecretKeyError):
        box.open(sealed, "sec_a:2")
