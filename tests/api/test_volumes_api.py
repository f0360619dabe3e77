"""Volumes through the real REST app, the content API and real loop-mounted images (no VM).

Shown: the control-plane wire (201 ``VolumeAndToken``, 404s, unique names, E2B-shaped
errors), the content API's calls with their exact codes and string ``code`` errors, Bearer
auth per volume, streaming uploads larger than the REST body limit, the quota as ENOSPC
(507) leaving no partial file, and that neither ``..`` nor a symlink leads out of a volume.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.config import Settings
from aenv.orchestrator.metrics import MetricsCollector
from aenv.orchestrator.service import Orchestrator
from aenv.orchestrator.volumes import Volumes
from aenv.storage import volumes as host
from aenv.store import Database, SandboxStore, TemplateStore
from aenv.store.volumes import VolumeStore
from tests.api.api_world import AUTH, KEY
from tests.orchestrator.test_orchestrator import FakeMachines

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")


@pytest.fixture
def world(tmp_path: Path):
    settings = Settings(home=tmp_path / "home", volume_size_mb=16)
    db = Database(tmp_path / "aenv.db")
    sandboxes, templates = SandboxStore(db), TemplateStore(db)
    service = Volumes(VolumeStore(db), sandboxes, settings)
    app = create_api(Orchestrator(sandboxes, templates, FakeMachines()), api_key=KEY,
                     domain="localhost", metrics=MetricsCollector(sandboxes),
                     logs=lambda *a, **k: [], volume_service=service)
    yield app, service, settings, tmp_path
    for rec in service.store.list():
        host.remove(settings, rec.id)
    db.close()


def call(app, method: str, path: str, *, auth: dict[str, str] | None = None,
         **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.request(method, path, headers=AUTH if auth is None else auth, **kw)
    return asyncio.run(go())


def make(app, name: str = "data") -> dict:
    r = call(app, "POST", "/volumes", json={"name": name})
    assert r.status_code == 201, r.text
    return r.json()


def test_control_plane(world) -> None:
    app, _, settings, _ = world
    vol = make(app)
    assert set(vol) == {"volumeID", "name", "token"} and vol["name"] == "data"
    assert host.is_mountpoint(host.volume_root(settings, vol["volumeID"]))
    assert call(app, "GET", f"/volumes/{vol['volumeID']}").json() == vol
    assert call(app, "GET", "/volumes").json() == [{"volumeID": vol["volumeID"],
                                                    "name": "data"}]
    r = call(app, "POST", "/volumes", json={"name": "data"})
    assert r.status_code == 409 and r.json()["code"] == 409
    for bad in ({"name": ""}, {"name": "a/b"}, {}, {"name": 3}):
        r = call(app, "POST", "/volumes", json=bad)
        assert r.status_code == 400 and set(r.json()) == {"code", "message"}, bad
    assert call(app, "POST", "/volumes", json={"name": "x"}, auth={}).status_code == 401
    assert call(app, "POST", "/volumes", json={"name": "x", "sizeMB": 17}).status_code == 400
    small = call(app, "POST", "/volumes", json={"name": "small", "sizeMB": 16}).json()
    assert host.usage(settings, small["volumeID"])[1] <= 16 * 1024 * 1024
    assert call(app, "GET", "/volumes/vol_nope").status_code == 404
    assert call(app, "DELETE", f"/volumes/{vol['volumeID']}").status_code == 204
    assert not (settings.home / "volumes" / vol["volumeID"]).exists()
    assert call(app, "DELETE", f"/volumes/{vol['volumeID']}").status_code == 404


def content(app, vol: dict, method: str, what: str, **kw) -> httpx.Response:
    auth = {"Authorization": f"Bearer {vol['token']}"}
    return call(app, method, f"/volumecontent/{vol['volumeID']}/{what}", auth=auth, **kw)


def test_content_calls(world) -> None:
    app, _, _, _ = world
    vol = make(app)
    r = content(app, vol, "PUT", "file", params={"path": "/dir/a.txt", "mode": "420"},
                content=b"hello")
    assert r.status_code == 201, r.text
    st = r.json()
    assert st["type"] == "file" and st["size"] == 5 and st["mode"] == 0o644
    assert st["path"] == "/dir/a.txt" and st["name"] == "a.txt" and st["uid"] == 1000
    r = content(app, vol, "PUT", "file", params={"path": "/dir/a.txt"}, content=b"x")
    assert r.status_code == 409 and isinstance(r.json()["code"], str)
    r = content(app, vol, "PUT", "file", params={"path": "/dir/a.txt", "force": "true",
                                                 "uid": "0", "gid": "0", "mode": "384"},
                content=b"again")
    assert r.status_code == 201 and (r.json()["uid"], r.json()["mode"]) == (0, 0o600)
    assert content(app, vol, "GET", "file", params={"path": "/dir/a.txt"}).content == b"again"
    assert content(app, vol, "GET", "path", params={"path": "/dir"}).json()["type"] == \
        "directory"
    assert content(app, vol, "GET", "path", params={"path": "/nope"}).status_code == 404
    r = content(app, vol, "POST", "dir", params={"path": "/dir"})
    assert r.status_code == 409
    r = content(app, vol, "POST", "dir", params={"path": "/p/q/r", "force": "true",
                                                 "mode": "493"})
    assert r.status_code == 201 and r.json()["mode"] == 0o755
    assert content(app, vol, "POST", "dir", params={"path": "/x/y"}).status_code == 404
    listing = content(app, vol, "GET", "dir", params={"path": "/"}).json()
    assert [e["path"] for e in listing] == ["/dir", "/p"]
    deep = content(app, vol, "GET", "dir", params={"path": "/", "depth": "3"}).json()
    assert {e["path"] for e in deep} == {"/dir", "/dir/a.txt", "/p", "/p/q", "/p/q/r"}
    r = content(app, vol, "PATCH", "path", params={"path": "/dir/a.txt"},
                json={"mode": 0o640, "uid": 1000})
    assert r.status_code == 200 and (r.json()["mode"], r.json()["uid"]) == (0o640, 1000)
    assert content(app, vol, "PATCH", "path", params={"path": "/nope"},
                   json={"mode": 1}).status_code == 404
    assert content(app, vol, "DELETE", "path", params={"path": "/p"}).status_code == 204
    assert content(app, vol, "DELETE", "path", params={"path": "/p"}).status_code == 404
    assert content(app, vol, "GET", "dir", params={"path": "/nope"}).status_code == 404
    assert content(app, vol, "GET", "dir", params={}).status_code == 400
    assert content(app, vol, "PUT", "file", params={"path": "/b", "mode": "abc"},
                   content=b"").status_code == 400


def test_auth_is_per_volume(world) -> None:
    app, _, _, _ = world
    a, b = make(app, "a"), make(app, "b")
    wrong = {**a, "token": b["token"]}
    r = content(app, wrong, "GET", "dir", params={"path": "/"})
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert call(app, "GET", f"/volumecontent/{a['volumeID']}/dir?path=/").status_code == 401
    # the API key is not a volume token
    assert call(app, "GET", f"/volumecontent/{a['volumeID']}/dir?path=/",
                auth={"Authorization": f"Bearer {KEY}"}).status_code == 401


def test_no_escape(world) -> None:
    app, _, settings, tmp_path = world
    vol = make(app)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("top")
    root = host.volume_root(settings, vol["volumeID"])
    os.symlink(outside, root / "link")
    os.symlink(outside / "secret", root / "file-link")
    for path in ("/../outside/secret", "/a/../../x"):
        r = content(app, vol, "GET", "file", params={"path": path})
        assert r.status_code == 400, path
    assert content(app, vol, "GET", "file", params={"path": "/link/secret"}).status_code \
        == 400
    assert content(app, vol, "GET", "file", params={"path": "/file-link"}).status_code == 400
    r = content(app, vol, "PUT", "file", params={"path": "/link/new", "force": "true"},
                content=b"x")
    assert r.status_code == 400 and not (outside / "new").exists()
    info = content(app, vol, "GET", "path", params={"path": "/link"}).json()
    assert info["type"] == "symlink" and info["target"] == str(outside)
    assert content(app, vol, "DELETE", "path", params={"path": "/link"}).status_code == 204
    assert (outside / "secret").read_text() == "top"


def test_stream_upload_and_quota(world) -> None:
    app, _, settings, _ = world
    vol = make(app)
    big = os.urandom(3 * 1024 * 1024)  # over the REST API's 1 MiB body limit

    async def chunks():  # sent chunked, as the JS SDK sends every upload
        for i in range(0, len(big), 100_000):
            yield big[i:i + 100_000]

    r = content(app, vol, "PUT", "file", params={"path": "/big"}, content=chunks())
    assert r.status_code == 201 and r.json()["size"] == len(big)
    assert content(app, vol, "GET", "file", params={"path": "/big"}).content == big
    too_big = b"\0" * (20 * 1024 * 1024)  # the volume is 16 MiB
    r = content(app, vol, "PUT", "file", params={"path": "/huge"}, content=too_big)
    assert r.status_code == 507 and "full" in r.json()["message"]
    names = [e["name"] for e in content(app, vol, "GET", "dir", params={"path": "/"}).json()]
    assert names == ["big"]
    assert not [n for n in os.listdir(host.volume_root(settings, vol["volumeID"]))
                if n != "big"]  # no temporary file left


def test_mounts_are_resolved_by_name(world) -> None:
    app, service, _, _ = world
    vol = make(app)
    got = service.resolve_mounts([{"name": "data", "path": "/mnt/data/"}])
    assert got == [{"name": "data", "path": "/mnt/data", "volumeID": vol["volumeID"]}]
    from aenv.orchestrator.errors import InvalidRequest
    for bad in ([{"name": "nope", "path": "/x"}], [{"name": "data", "path": "rel"}],
                [{"name": "data", "path": "/"}],
                [{"name": "data", "path": "/a"}, {"name": "data", "path": "/a/b"}]):
        with pytest.raises(InvalidRequest):
            service.resolve_mounts(bad)
