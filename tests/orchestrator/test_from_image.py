"""A build's ``fromImage``: checked at the start, credentials kept out of the store, the
pulled image standing in as the parent with its config applied, failures as build errors.
The image source is a fake here; tests/storage has the registry, tests/guest the boot."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from aenv.orchestrator.builds import Builder
from aenv.orchestrator.errors import InvalidRequest
from aenv.orchestrator.from_image import (
    ImageRequest,
    PreparedImage,
    image_settings,
    is_e2b_base,
)
from aenv.orchestrator.machine import Placement
from aenv.storage.registry_errors import AuthFailed
from aenv.store import Database, TemplateRecord, TemplateStore
from tests.orchestrator.test_builds import ready_base
from tests.orchestrator.test_orchestrator import FakeMachines

IMAGE = "image:" + "ab" * 32
SECRET = "hunter2-not-in-the-store"


class Images:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.requests: list[ImageRequest] = []

    def prepare(self, request: ImageRequest, say) -> PreparedImage:
        self.requests.append(request)
        say(f"pulling {request.reference}")
        if self.error is not None:
            raise self.error
        return PreparedImage(IMAGE, {"PATH": "/usr/local/go/bin:/usr/bin:/bin", "GOPATH": "/go"},
                             "/go", None, "sha256:" + "cd" * 32)


class Machines(FakeMachines):
    """Records what each start boots; its envd is a closed loopback port, so the build's
    first call into the guest fails at once (no traffic leaves the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.templates: list[TemplateRecord] = []

    async def start(self, rec, template) -> Placement:
        self.templates.append(template)
        return dataclasses.replace(await super().start(rec, template), host_ip="127.0.0.1")


@pytest.fixture
def world(tmp_path):
    images, machines = Images(), Machines()
    builder = Builder(TemplateStore(Database(tmp_path / "aenv.db")), machines,
                      tmp_path / "files", images=images)
    ready_base(builder)
    return builder, images, machines


async def _settled(builder: Builder, build_id: str):
    for _ in range(200):
        b = builder.templates.get_build(build_id)
        if b.status in ("ready", "error"):
            return b
        await asyncio.sleep(0.02)
    raise AssertionError("the build did not finish")


async def test_the_pulled_image_is_the_parent_with_its_config(world) -> None:
    builder, images, machines = world
    tpl, build, _ = builder.request("go")
    builder.start(tpl.id, build.id, {"fromImage": "golang:1.22", "steps": []},
                  registry={"type": "registry", "username": "u", "password": SECRET})
    b = await _settled(builder, build.id)
    (req,) = images.requests
    assert str(req.reference) == "registry-1.docker.io/library/golang:1.22"
    assert req.credentials is not None and req.credentials.password == SECRET
    (parent,) = machines.templates
    assert parent.image == IMAGE
    assert parent.env_vars["GOPATH"] == "/go" and parent.workdir == "/go"
    assert parent.user == "user"  # the image names no user: E2B's default
    # Nothing answers on the guest's envd here, so the build fails after the start.
    assert b.status == "error" and b.reason_step == "finalize"
    logs = [e["message"] for e in builder.templates.logs(build.id, 0, 1000)]
    assert any("pulling registry-1.docker.io/library/golang:1.22" in m for m in logs)
    stored = json.dumps(builder.templates.get_build(build.id).spec)
    assert SECRET not in stored and "fromImageRegistry" not in stored


async def test_a_pull_error_is_the_builds_error_at_the_base_step(world) -> None:
    builder, images, _ = world
    images.error = AuthFailed("registry refused the credentials for 'reg.test/x:1'")
    tpl, build, _ = builder.request("denied")
    builder.start(tpl.id, build.id, {"fromImage": "reg.test/x:1"})
    b = await _settled(builder, build.id)
    assert (b.status, b.reason_step) == ("error", "base")
    assert b.reason == "registry refused the credentials for 'reg.test/x:1'"
    assert builder.templates.get(tpl.id).status == "error"


@pytest.mark.parametrize(("spec", "registry", "match"), [
    ({"fromImage": "Not A Ref"}, None, "not an image reference"),
    ({"fromImage": "x:1"}, {"type": "aws", "awsAccessKeyId": "k"}, "type 'aws'"),
    ({"fromImage": "x:1"}, {"type": "registry", "username": "u"}, "a username and a password"),
    ({"fromImage": "x:1", "fromTemplate": "base"}, None, "exclusive"),
])
def test_a_bad_image_request_is_refused_at_the_start(world, spec, registry, match) -> None:
    builder, images, _ = world
    tpl, build, _ = builder.request("bad")
    with pytest.raises(InvalidRequest, match=match):
        builder.start(tpl.id, build.id, spec, registry=registry)
    assert builder.templates.get_build(build.id).status == "error"
    assert images.requests == []


async def test_e2bs_base_image_is_the_base_template(world) -> None:
    builder, images, machines = world
    tpl, build, _ = builder.request("from-base")
    builder.start(tpl.id, build.id, {"fromImage": "e2bdev/base"})
    await _settled(builder, build.id)
    assert images.requests == [] and machines.templates[0].id == "base"


def test_e2b_base_names_and_image_config() -> None:
    assert is_e2b_base("e2bdev/base") and is_e2b_base("docker.io/e2bdev/base:latest")
    assert not is_e2b_base("e2bdev/base-python") and not is_e2b_base("base")
    env, workdir, user = image_settings({"Env": ["A=1", "B=x=y", "junk", "=v"],
                                         "WorkingDir": "/app", "User": "1000:1000"})
    assert env == {"A": "1", "B": "x=y"} and workdir == "/app" and user == "1000"
    assert image_settings({}) == ({}, None, None)
