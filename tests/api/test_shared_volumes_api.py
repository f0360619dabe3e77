"""Shared volumes through two nodes' real REST apps over one shared store (no VM, no mount):
what one node makes the other lists, serves and deletes; the content API of either reads
and writes the same files and holds uploads to the volume's size (soft here); a delete is
refused while a sandbox of either node, or a create in flight on either, mounts the
volume, and goes through once the other node's users file is stale."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.api.app import create_api
from aenv.config import Settings
from aenv.orchestrator.errors import InvalidRequest
from aenv.orchestrator.metrics import MetricsCollector
from aenv.orchestrator.service import Orchestrator
from aenv.orchestrator.volumes import Volumes
from aenv.server import _warn_of_local_volumes
from aenv.storage.shared_volumes import SharedVolumes
from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore, TemplateStore
from aenv.store.volumes import VolumeStore
from tests.api.api_world import AUTH, KEY
from tests.orchestrator.test_orchestrator import FakeMachines

MIB = 1024 * 1024


@dataclass
class Node:
    app: object
    volumes: Volumes
    sandboxes: SandboxStore

    def call(self, method: str, path: str, *, auth: dict[str, str] | None = None,
             **kw: object) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),  # type: ignore[arg-type]
                                         base_url="http://t") as c:
                return await c.request(method, path, headers=AUTH if auth is None else auth,
                                       **kw)  # type: ignore[arg-type]
        return asyncio.run(go())


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    shared = tmp_path / "shared"
    made, dbs = [], []
    for node_id in ("n1", "n2"):
        settings = Settings(home=tmp_path / node_id, volume_size_mb=16, shared_store=shared)
        db = Database(tmp_path / f"{node_id}.db")
        dbs.append(db)
        sandboxes = SandboxStore(db)
        service = Volumes(VolumeStore(db), sandboxes, settings,
                          SharedVolumes(shared, node_id, users_stale_s=2.0))
        app = create_api(Orchestrator(sandboxes, TemplateStore(db), FakeMachines()),
                         api_key=KEY, domain="localhost",
                         metrics=MetricsCollector(sandboxes), logs=lambda *a, **k: [],
                         volume_service=service)
        made.append(Node(app, service, sandboxes))
    yield made[0], made[1]
    for db in dbs:
        db.close()


def _mounting(node: Node, sandbox_id: str, volume_id: str, state: SandboxState) -> None:
    node.sandboxes.insert(SandboxRecord(
        id=sandbox_id, template_id="base", state=state, client_id="c", started_at=1.0,
        end_at=2.0, cpu_count=1, memory_mb=512, disk_size_mb=2048,
        volume_mounts=[{"name": "data", "path": "/data", "volumeID": volume_id}]))
    node.volumes.publish_users()


def test_a_volume_made_on_one_node_is_served_by_the_other(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    r = n1.call("POST", "/volumes", json={"name": "data"})
    assert r.status_code == 201, r.text
    vol = r.json()
    assert n2.call("GET", f"/volumes/{vol['volumeID']}").json() == vol
    assert n2.call("GET", "/volumes").json() == [{"volumeID": vol["volumeID"], "name": "data"}]
    assert n2.call("POST", "/volumes", json={"name": "data"}).status_code == 409
    bearer = {"Authorization": f"Bearer {vol['token']}"}
    path = f"/volumecontent/{vol['volumeID']}"
    r = n1.call("PUT", f"{path}/file", params={"path": "/a.txt"}, content=b"one", auth=bearer)
    assert r.status_code == 201, r.text
    r = n2.call("GET", f"{path}/file", params={"path": "/a.txt"}, auth=bearer)
    assert r.status_code == 200 and r.content == b"one"
    assert n2.call("GET", f"{path}/dir", params={"path": "/"},
                   auth={"Authorization": "Bearer nope"}).status_code == 401
    assert n1.call("DELETE", f"/volumes/{vol['volumeID']}").status_code == 204
    assert n2.call("GET", f"/volumes/{vol['volumeID']}").status_code == 404
    assert n2.call("GET", f"{path}/dir", params={"path": "/"}, auth=bearer).status_code == 401


def test_uploads_are_held_to_the_volumes_size(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    vol = n1.call("POST", "/volumes", json={"name": "small"}).json()
    bearer = {"Authorization": f"Bearer {vol['token']}"}
    path = f"/volumecontent/{vol['volumeID']}/file"
    r = n2.call("PUT", path, params={"path": "/a"}, content=b"a" * (10 * MIB), auth=bearer)
    assert r.status_code == 201, r.text
    r = n1.call("PUT", path, params={"path": "/b"}, content=b"b" * (10 * MIB), auth=bearer)
    assert r.status_code == 507 and r.json()["code"] == "insufficient_storage", r.text
    listed = n1.call("GET", f"/volumecontent/{vol['volumeID']}/dir", params={"path": "/"},
                     auth=bearer).json()
    assert [e["name"] for e in listed] == ["a"]   # no partial file


def test_a_delete_waits_for_every_nodes_sandboxes_and_creates(
        nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    vol = n1.call("POST", "/volumes", json={"name": "data"}).json()
    vid = vol["volumeID"]
    _mounting(n2, "paused-on-n2", vid, SandboxState.PAUSED)
    r = n1.call("DELETE", f"/volumes/{vid}")
    assert r.status_code == 409 and "paused-on-n2 (node n2)" in r.json()["message"], r.text
    assert n2.sandboxes.transition("paused-on-n2", [SandboxState.PAUSED], SandboxState.KILLING)
    assert n2.sandboxes.transition("paused-on-n2", [SandboxState.KILLING], SandboxState.KILLED)
    n2.volumes.publish_users()
    # a create in flight on n1 holds it until it ends
    mounts = n1.volumes.resolve_mounts([{"name": "data", "path": "/d"}])
    r = n2.call("DELETE", f"/volumes/{vid}")
    assert r.status_code == 409 and "being created" in r.json()["message"], r.text
    asyncio.run(n1.volumes.release(mounts))
    # n2's users file goes stale when n2 stops writing it (a dead node blocks for a while)
    _mounting(n2, "on-a-dead-node", vid, SandboxState.RUNNING)
    assert n1.call("DELETE", f"/volumes/{vid}").status_code == 409
    asyncio.run(asyncio.sleep(2.2))
    assert n1.call("DELETE", f"/volumes/{vid}").status_code == 204


def test_a_sandbox_that_ends_frees_its_volume_at_once_on_every_node(
        nodes: tuple[Node, Node]) -> None:
    """The server hooks ``sandbox_stopped`` to every end (``Orchestrator.on_stop``): a
    delete sent to another node right after a kill does not wait for the next refresh."""
    n1, n2 = nodes
    vid = n1.call("POST", "/volumes", json={"name": "data"}).json()["volumeID"]
    _mounting(n2, "killed-on-n2", vid, SandboxState.RUNNING)
    assert n1.call("DELETE", f"/volumes/{vid}").status_code == 409
    assert n2.sandboxes.transition("killed-on-n2", [SandboxState.RUNNING], SandboxState.KILLING)
    assert n2.sandboxes.transition("killed-on-n2", [SandboxState.KILLING], SandboxState.KILLED)
    asyncio.run(n2.volumes.sandbox_stopped("killed-on-n2"))
    assert n1.call("DELETE", f"/volumes/{vid}").status_code == 204


def test_a_create_cannot_mount_a_volume_being_deleted(nodes: tuple[Node, Node]) -> None:
    n1, n2 = nodes
    vid = n1.call("POST", "/volumes", json={"name": "data"}).json()["volumeID"]
    shared = n1.volumes.shared
    assert shared is not None and shared.begin_delete(vid)
    with pytest.raises(InvalidRequest):
        n2.volumes.resolve_mounts([{"name": "data", "path": "/d"}])
    assert n2.volumes.users(vid) == []   # it let go of what it held
    shared.end_delete(vid)
    assert n2.volumes.resolve_mounts([{"name": "data", "path": "/d"}])[0]["volumeID"] == vid


def test_volumes_made_before_the_shared_store_are_named_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A node given a shared store serves only its volumes; those it made before are kept
    on disk, and each start says which, instead of letting them vanish unexplained."""
    db = Database(tmp_path / "aenv.db")
    store = VolumeStore(db)
    settings = Settings(home=tmp_path / "home", shared_store=tmp_path / "shared")
    _warn_of_local_volumes(store, settings)
    assert "before AENV_SHARED_STORE" not in caplog.text
    store.insert("datasets", 16)
    _warn_of_local_volumes(store, settings)
    assert "1 volume(s) made before AENV_SHARED_STORE" in caplog.text
    assert "datasets" in caplog.text and str(tmp_path / "home" / "volumes") in caplog.text
    db.close()
