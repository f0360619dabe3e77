"""Template tags through the real E2B SDKs against ``aenv server`` with microVM sandboxes.

One template is built (``<name>:v1`` with ``tags=["stable"]``) and shared by every test:
they assign tags to its build, create sandboxes from ``name:tag``, list and remove tags,
and send the wrong inputs E2B's own tag tests send. Each test assigns tags of its own, so
they do not depend on one another's order.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import NamedTuple

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException, TemplateException

from tests.conftest import run_json_script
from tests.jsflow import JS_DIR

pytestmark = [pytest.mark.vm, pytest.mark.net]


class Built(NamedTuple):
    name: str
    template_id: str
    build_id: str
    tags: list[str]


@pytest.fixture(scope="module")
def built(live_server) -> Iterator[Built]:
    """The shared build, made with the SDK configured only through its environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_KEY", live_server.api_key)
        mp.setenv("E2B_API_URL", live_server.url)
        mp.setenv("E2B_SANDBOX_URL", live_server.url)
        mp.delenv("E2B_DOMAIN", raising=False)
        name = f"e2e-tags-{uuid.uuid4().hex[:8]}"
        template = Template().from_template("base").run_cmd(
            "echo built-with-tags > /home/user/build.txt")
        info = Template.build(template, f"{name}:v1", tags=["stable"])
        yield Built(name, info.template_id, info.build_id, info.tags)


@pytest.fixture
def e2b(built: Built, sdk) -> Built:
    return built


def content(ref: str) -> str:
    sbx = Sandbox.create(ref)
    try:
        return sbx.commands.run("cat /home/user/build.txt").stdout
    finally:
        sbx.kill()


def test_a_build_with_tags_answers_them_and_a_uuid_build_id(e2b: Built) -> None:
    assert e2b.tags == ["v1", "stable"]
    uuid.UUID(e2b.build_id)


def test_a_tag_assigned_to_the_build_creates_sandboxes_from_it(e2b: Built) -> None:
    info = Template.assign_tags(f"{e2b.name}:v1", "prod")
    assert info.build_id == e2b.build_id and info.tags == ["prod"]
    assert content(f"{e2b.name}:prod") == "built-with-tags\n"


def test_get_tags_lists_each_tag_with_its_build(e2b: Built) -> None:
    Template.assign_tags(f"{e2b.name}:stable", ["listed-a", "listed-b"])
    tags = {t.tag: t for t in Template.get_tags(e2b.name)}
    assert {"default", "v1", "stable", "listed-a", "listed-b"} <= set(tags)
    assert {t.build_id for t in tags.values()} == {e2b.build_id}
    assert all(isinstance(t.created_at, datetime) for t in tags.values())
    # A reference with a tag (sent as name%3Av1) and the template id list the same.
    assert {t.tag for t in Template.get_tags(f"{e2b.name}:v1")} == set(tags)
    assert {t.tag for t in Template.get_tags(e2b.template_id)} == set(tags)


def test_a_removed_tag_no_longer_creates_sandboxes(e2b: Built) -> None:
    Template.assign_tags(f"{e2b.name}:v1", ["gone", "kept"])
    assert Template.exists(f"{e2b.name}:gone")
    Template.remove_tags(e2b.name, "gone")
    tags = {t.tag for t in Template.get_tags(e2b.name)}
    assert "gone" not in tags and "kept" in tags
    assert not Template.exists(f"{e2b.name}:gone")
    with pytest.raises(SandboxException, match="404") as e:
        Sandbox.create(f"{e2b.name}:gone")
    assert e.value.status_code == 404
    # The name alone is the default tag: with none assigned, the latest build.
    assert content(e2b.name) == "built-with-tags\n"


@pytest.mark.parametrize(("call", "status"), [
    # E2B's own tests (python-sdk tests/sync/template_sync/test_tags.py): malformed tags.
    (lambda n: Template.assign_tags(f"{n}:v1", ":invalid-tag"), 400),
    (lambda n: Template.assign_tags(f"{n}:v1", f"{n}:"), 400),
    (lambda n: Template.assign_tags(f"{n}:v1", []), 400),
    (lambda n: Template.assign_tags(f"{n}:no-such-tag", "x"), 404),
    (lambda n: Template.assign_tags("no-such-template:v1", "x"), 404),
    (lambda n: Template.remove_tags(n, "default"), 400),
    (lambda n: Template.remove_tags(f"{n}:v1", "x"), 400),
    (lambda n: Template.remove_tags("no-such-template", "x"), 404),
    (lambda n: Template.get_tags("no-such-template"), 404),
])
def test_wrong_inputs_raise_e2bs_codes(e2b: Built, call, status) -> None:
    with pytest.raises(TemplateException, match=f"^{status}: "):
        call(e2b.name)
    assert {"v1", "stable"} <= {t.tag for t in Template.get_tags(e2b.name)}


@pytest.mark.js
def test_the_js_sdk_assigns_lists_creates_from_and_removes_tags(e2b: Built, sdk) -> None:
    out = run_json_script(["node", "template_tags.mjs"],
                          {"E2B_API_KEY": sdk.api_key, "E2B_API_URL": sdk.url,
                           "E2B_SANDBOX_URL": sdk.url, "AENV_JS_TEMPLATE": e2b.name},
                          cwd=JS_DIR, timeout=300)
    assert out["assigned"] == {"buildId": e2b.build_id, "tags": ["js"]}
    tags = {t["tag"]: t for t in out["tags"]}
    assert {"default", "v1", "stable", "js"} <= set(tags)
    assert all(t["buildId"] == e2b.build_id and t["createdAtIsDate"] for t in tags.values())
    assert set(out["tagsByEncodedRef"]) == set(tags)
    assert out["content"] == "built-with-tags\n"
    assert out["removedReturnsUndefined"] is True and "js" not in out["tagsAfterRemove"]
    assert out["createRemoved"][0] == "SandboxError"
    assert out["createRemoved"][1].startswith("404: ")
    assert out["existsRemoved"] is False and out["existsV1"] is True
    for key, status in (("assignInvalid", 400), ("assignMissingTag", 400),
                        ("assignUnknownTarget", 404), ("removeDefault", 400),
                        ("removeUnknown", 404), ("tagsUnknown", 404)):
        assert out[key] is not None, key
        assert out[key][0] == "TemplateError" and out[key][1].startswith(f"{status}: "), \
            (key, out[key])


# Last: these rebuild the shared template.


def test_a_rebuild_takes_its_tags_and_the_others_keep_the_older_build(e2b: Built) -> None:
    template = Template().from_template("base").run_cmd("echo rebuilt > /home/user/build.txt")
    info = Template.build(template, e2b.name, tags=["stable"])
    assert info.template_id == e2b.template_id and info.tags == ["stable"]
    tags = {t.tag: t.build_id for t in Template.get_tags(e2b.name)}
    assert tags["stable"] == tags["default"] == info.build_id
    assert tags["v1"] == e2b.build_id
    assert content(f"{e2b.name}:v1") == "built-with-tags\n"
    assert content(f"{e2b.name}:stable") == "rebuilt\n"
    assert content(e2b.name) == "rebuilt\n"


def test_an_older_tagged_build_outlives_garbage_collection(e2b: Built) -> None:
    assert {t.tag: t.build_id for t in Template.get_tags(e2b.name)}["v1"] == e2b.build_id
    assert content(f"{e2b.name}:v1") == "built-with-tags\n"
