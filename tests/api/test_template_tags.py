"""Template tags through the real REST app, store and builder, without a VM: builds run
their steps against a stand-in envd, so they finish in milliseconds.

What is shown: the wire of E2B's three tag routes (spec part 2, section 2) and of ``POST
/v3/templates`` with tags, E2B's error codes for wrong inputs, how ``name``, ``name:tag``,
an id and ``name:<build id>`` resolve, that a rebuild takes over only the tags it was built
with, that a removed tag no longer resolves, and that the tags named by names of the old
scheme (``x:t`` beside ``x``) survive the migration.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import httpx
import pytest

from aenv.client.envd import CommandResult
from aenv.orchestrator import builds
from aenv.store import Database, TemplateRecord, TemplateStore
from aenv.store.db import _MIGRATIONS
from tests.api.api_world import World, world_client


class FakeEnvd:
    """Every command of a build succeeds."""

    def __init__(self, *_, **__) -> None:
        pass

    async def run(self, cmd, **_) -> CommandResult:
        return CommandResult(0, "", "")

    async def start_background(self, *_, **__) -> None:
        pass

    async def aclose(self) -> None:
        pass


@pytest.fixture
async def api(tmp_path, monkeypatch):
    monkeypatch.setattr(builds, "EnvdClient", FakeEnvd)
    async with world_client(tmp_path / "build-files") as (world, c):
        yield world, c
    await world.builder.close()


async def build(c: httpx.AsyncClient, name: str, tags: list[str] | None = None, *,
                marker: str = "1", ok: bool = True) -> dict:
    """A build as the SDK makes it; ``marker`` lands in the template's env (V), which is
    how a test tells builds apart. Returns the v3 answer once the build ended."""
    body = {"name": name, **({"tags": tags} if tags is not None else {})}
    r = await c.post("/v3/templates", json=body)
    assert r.status_code == 202, r.text
    out = r.json()
    steps = [{"type": "ENV", "args": ["V", marker]}] + ([] if ok else [{"type": "ENV"}])
    r = await c.post(f"/v2/templates/{out['templateID']}/builds/{out['buildID']}",
                     json={"fromTemplate": "base", "steps": steps, "force": False})
    assert r.status_code == 202, r.text
    for _ in range(500):
        r = await c.get(f"/templates/{out['templateID']}/builds/{out['buildID']}/status")
        if r.json()["status"] in ("ready", "error"):
            assert r.json()["status"] == ("ready" if ok else "error"), r.json()
            return out
        await asyncio.sleep(0.01)
    raise AssertionError("the build did not end")


async def tags_of(c: httpx.AsyncClient, ref: str) -> dict[str, str]:
    r = await c.get(f"/templates/{ref}/tags")
    assert r.status_code == 200, r.text
    return {t["tag"]: t["buildID"] for t in r.json()}


def marker(world: World, ref: str) -> str | None:
    """V of what ``ref`` resolves to (as a create would start it), None if nothing."""
    tpl = world.orchestrator.templates.get(ref)
    return None if tpl is None else tpl.env_vars.get("V")


async def create(c: httpx.AsyncClient, ref: str) -> httpx.Response:
    return await c.post("/v2/sandboxes", json={"templateID": ref})


def assert_e2b(r: httpx.Response, status: int, words: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == status and words in body["message"], body


# -- building with tags ---------------------------------------------------------------------


async def test_a_build_answers_the_tags_of_its_name_and_list_and_a_uuid_build_id(api) -> None:
    _, c = api
    r = await c.post("/v3/templates", json={"name": "app:v1", "tags": [" Stable ", "v1"]})
    assert r.status_code == 202, r.text
    out = r.json()
    assert out["tags"] == ["v1", "stable"]
    assert out["names"] == ["app"] and out["aliases"] == ["app"] and out["public"] is False
    uuid.UUID(out["buildID"])


@pytest.mark.parametrize(("name", "tags"), [("app", None), ("app:default", None),
                                            ("app", [])])
async def test_a_build_without_tags_gets_default(api, name, tags) -> None:
    _, c = api
    body = {"name": name, **({"tags": tags} if tags is not None else {})}
    assert (await c.post("/v3/templates", json=body)).json()["tags"] == ["default"]


@pytest.mark.parametrize(("body", "words"), [
    ({"name": "app:"}, "Invalid name"),
    ({"name": ":v1"}, "Invalid name"),
    ({"name": "app:v 1"}, "Invalid name"),
    ({"name": "app", "tags": [":invalid-tag"]}, "Invalid tag"),
    ({"name": "app", "tags": ["app:"]}, "Invalid tag"),
    ({"name": "app", "tags": [str(uuid.uuid4())]}, "cannot be a UUID"),
])
async def test_a_build_with_a_malformed_tag_is_400(api, body, words) -> None:
    _, c = api
    assert_e2b(await c.post("/v3/templates", json=body), 400, words)


async def test_tags_reach_a_build_when_it_is_ready(api) -> None:
    world, c = api
    out = await build(c, "app:v1", ["stable"])
    assert await tags_of(c, "app") == {"default": out["buildID"], "v1": out["buildID"],
                                       "stable": out["buildID"]}
    for ref in ("app", "app:v1", "app:STABLE", "app:default", out["templateID"]):
        assert marker(world, ref) == "1", ref
    assert marker(world, "app:other") is None


async def test_a_failed_build_takes_no_tag(api) -> None:
    world, c = api
    first = await build(c, "app", ["v1"])
    await build(c, "app", ["v1", "v2"], marker="2", ok=False)
    assert await tags_of(c, "app") == {"default": first["buildID"], "v1": first["buildID"]}
    assert marker(world, "app:v2") is None


# -- assign, list, remove -------------------------------------------------------------------


async def test_assign_points_new_tags_at_the_targets_build(api) -> None:
    world, c = api
    out = await build(c, "app")
    r = await c.post("/templates/tags", json={"target": "app:default",
                                              "tags": ["prod", "Latest", "prod"]})
    assert r.status_code == 201, r.text
    assert r.json() == {"tags": ["prod", "latest"], "buildID": out["buildID"]}
    listed = (await c.get("/templates/app/tags")).json()
    assert [t["tag"] for t in listed] == ["default", "latest", "prod"]
    assert {t["buildID"] for t in listed} == {out["buildID"]}
    assert all(t["createdAt"].endswith("Z") for t in listed)
    assert marker(world, "app:prod") == "1"
    r = await create(c, "app:prod")
    assert r.status_code == 201, r.text
    assert r.json()["templateID"] == out["templateID"]


async def test_a_target_without_a_tag_means_default(api) -> None:
    _, c = api
    out = await build(c, "app")
    r = await c.post("/templates/tags", json={"target": "app", "tags": ["x"]})
    assert r.json() == {"tags": ["x"], "buildID": out["buildID"]}


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"target": "app:v1", "tags": []}, 400, "At least one tag is required"),
    ({"target": "app:v1", "tags": [":invalid-tag"]}, 400, "Invalid tag"),
    ({"target": "app:v1", "tags": ["app:"]}, 400, "Invalid tag"),
    ({"target": "app:", "tags": ["x"]}, 400, "Invalid target template format"),
    ({"target": "nope:v1", "tags": ["x"]}, 404, "template 'nope' not found"),
    ({"target": "app:v9", "tags": ["x"]}, 404, "Template 'app:v9' with tag 'v9' not found"),
    ({"target": "app:v1", "tags": "x"}, 400, "invalid request"),
    ({"tags": ["x"]}, 400, "invalid request"),
])
async def test_assign_with_wrong_inputs_answers_e2bs_codes(api, body, status, words) -> None:
    _, c = api
    await build(c, "app:v1")
    assert_e2b(await c.post("/templates/tags", json=body), status, words)


async def test_a_removed_tag_no_longer_resolves(api) -> None:
    world, c = api
    await build(c, "app", ["v1", "v2"])
    r = await c.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["V1"]})
    assert r.status_code == 204, r.text
    assert set(await tags_of(c, "app")) == {"default", "v2"}
    assert_e2b(await create(c, "app:v1"), 404, "not found")
    assert_e2b(await c.post("/templates/tags", json={"target": "app:v1", "tags": ["x"]}),
               404, "with tag 'v1' not found")
    assert_e2b(await c.get("/templates/aliases/app:v1"), 404, "tag 'v1' does not exist")
    assert (await c.get("/templates/aliases/app:v2")).status_code == 200
    assert marker(world, "app:v2") == "1"
    # Removing what is not there is no error (E2B deletes by query).
    r = await c.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["v1"]})
    assert r.status_code == 204


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"name": "app", "tags": ["default"]}, 400, "Cannot delete the 'default' tag"),
    ({"name": "app", "tags": ["DEFAULT", "v1"]}, 400, "Cannot delete the 'default' tag"),
    ({"name": "app", "tags": []}, 400, "At least one tag is required"),
    ({"name": "app", "tags": [":x"]}, 400, "Invalid tag"),
    ({"name": "app:v1", "tags": ["v1"]}, 400, "should not contain a tag"),
    ({"name": "app:", "tags": ["v1"]}, 400, "Invalid template name format"),
    ({"name": "nope", "tags": ["v1"]}, 404, "template 'nope' not found"),
])
async def test_remove_with_wrong_inputs_answers_e2bs_codes(api, body, status, words) -> None:
    _, c = api
    await build(c, "app:v1")
    assert_e2b(await c.request("DELETE", "/templates/tags", json=body), status, words)
    assert "v1" in await tags_of(c, "app")


async def test_listing_takes_a_percent_encoded_reference_with_a_tag_or_a_namespace(api) -> None:
    _, c = api
    out = await build(c, "ns/app:v1")
    assert await tags_of(c, "ns%2Fapp%3Av1") == {"default": out["buildID"],
                                                 "v1": out["buildID"]}
    assert await tags_of(c, out["templateID"]) == await tags_of(c, "ns%2Fapp")
    assert (await c.get("/templates/aliases/ns%2Fapp%3Av1")).status_code == 200
    assert_e2b(await c.get("/templates/nope/tags"), 404, "template 'nope' not found")
    assert_e2b(await c.get("/templates/app%3A/tags"), 400, "Invalid template reference")


async def test_tag_answers_for_the_built_in_template_carry_a_uuid(api) -> None:
    _, c = api
    r = await c.post("/templates/tags", json={"target": "base", "tags": ["mine"]})
    assert r.status_code == 201, r.text
    listed = await tags_of(c, "base")
    assert set(listed) == {"default", "mine"}
    assert listed["mine"] == listed["default"] == r.json()["buildID"]
    uuid.UUID(r.json()["buildID"])
    assert (await create(c, "base:mine")).status_code == 201


# -- rebuilds -------------------------------------------------------------------------------


async def test_a_rebuild_takes_its_tags_and_the_other_tags_keep_their_build(api) -> None:
    world, c = api
    first = await build(c, "app", marker="1")
    await c.post("/templates/tags", json={"target": "app", "tags": ["v1"]})
    second = await build(c, "app", marker="2")
    assert first["templateID"] == second["templateID"]
    assert await tags_of(c, "app") == {"default": second["buildID"], "v1": first["buildID"]}
    assert marker(world, "app") == marker(world, "app:default") == "2"
    assert marker(world, first["templateID"]) == "2"
    assert marker(world, "app:v1") == "1"
    images = {ref: world.orchestrator.templates.get(ref).image for ref in ("app", "app:v1")}
    assert images["app"] != images["app:v1"]
    for ref in ("app", "app:v1"):
        r = await create(c, ref)
        assert r.status_code == 201, r.text
        assert world.machines.restored[-1] == (r.json()["sandboxID"], images[ref])
    # The older build is also named by its id.
    assert marker(world, f"app:{first['buildID']}") == "1"


async def test_a_build_with_only_a_new_tag_leaves_default_where_it_was(api) -> None:
    world, c = api
    first = await build(c, "app", marker="1")
    second = await build(c, "app:v2", marker="2")
    assert await tags_of(c, "app") == {"default": first["buildID"], "v2": second["buildID"]}
    assert marker(world, "app") == "1" and marker(world, "app:v2") == "2"


async def test_an_older_build_is_kept_only_while_a_tag_names_it(api) -> None:
    world, c = api
    await build(c, "app", ["v1", "default"], marker="1")
    old = world.orchestrator.templates.get("app:v1").image
    await build(c, "app", marker="2")
    assert old in world.orchestrator.templates.tagged_images()
    await c.request("DELETE", "/templates/tags", json={"name": "app", "tags": ["v1"]})
    assert old not in world.orchestrator.templates.tagged_images()


async def test_garbage_collection_keeps_the_image_of_an_older_tagged_build(api) -> None:
    world, c = api
    await build(c, "app", ["v1", "default"], marker="1")
    old = world.orchestrator.templates.get("app:v1").image
    await build(c, "app", marker="2")
    assert old in world.orchestrator.gc_roots()


async def test_deleting_a_template_deletes_its_tags(api) -> None:
    world, c = api
    out = await build(c, "app:v1")
    assert (await c.delete("/templates/app")).status_code == 204
    assert world.orchestrator.templates.tags(out["templateID"]) == []
    assert_e2b(await c.get("/templates/app/tags"), 404)
    assert_e2b(await create(c, "app:v1"), 404)
    again = await build(c, "app")
    assert await tags_of(c, "app") == {"default": again["buildID"]}


# -- the store ------------------------------------------------------------------------------


def test_names_with_a_tag_of_the_old_scheme_become_tags(tmp_path) -> None:
    """A database at schema 2, where a build's tags were names ``x:t`` beside ``x``."""
    path = tmp_path / "aenv.db"
    conn = sqlite3.connect(path)
    for script in _MIGRATIONS[:2]:
        conn.executescript(script)
    conn.execute("PRAGMA user_version = 2")
    for tid, kind in (("t1", "template"), ("s1", "snapshot")):
        conn.execute("INSERT INTO templates (id, kind, build_id, status, cpu_count, memory_mb, "
                     "disk_size_mb, created_at, updated_at) VALUES (?, ?, ?, 'ready', 1, 256, "
                     "1024, 1.0, 2.0)", (tid, kind, f"b-{tid}"))
    conn.executemany("INSERT INTO template_names VALUES (?, ?)", [
        ("app", "t1"), ("app:default", "t1"), ("app:V1", "t1"), ("other:x", "t1"),
        ("s1:default", "s1")])
    conn.commit()
    conn.close()
    store = TemplateStore(Database(path))
    assert {(t.tag, t.build_id) for t in store.tags("t1")} == {("default", "b-t1"),
                                                                ("v1", "b-t1")}
    assert store.get("t1").names == ["app", "other:x"]
    assert store.get("app:v1").id == "t1" and store.get("other:x").id == "t1"
    assert store.get("s1:default").id == "s1" and store.get("s1").names == ["s1:default"]


def test_a_tag_name_given_to_a_template_is_not_kept_as_a_name(tmp_path) -> None:
    store = TemplateStore(Database(tmp_path / "aenv.db"))
    store.insert(TemplateRecord(id="t1", kind="template", build_id="b1", status="ready",
                                cpu_count=1, memory_mb=256, disk_size_mb=1024,
                                created_at=1.0, updated_at=1.0, names=["app", "app:v1"]))
    store.add_name("t1", "app:v2")
    store.add_name("t1", "t1:v3")
    assert store.get("t1").names == ["app"]
    assert store.get("app:v2") is None  # a tag only once a build carries it
    assert store.get("app:default").id == "t1"
