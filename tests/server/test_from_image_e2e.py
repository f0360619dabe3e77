"""Templates from registry images through E2B's SDK: ``Template().from_image(ref)``, with
and without credentials, against a real ``docker-registry`` on loopback, then sandboxes
from them. The image is a static busybox (no libc, no bash, no Python): envd comes from
the tools drive, commands run in the image's root with its ``/bin/sh``, and the image's
``Env`` and ``WorkingDir`` apply."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from e2b.sandbox.commands.command_handle import CommandExitException

from tests.local_registry import (
    BUSYBOX_MARKER,
    BUSYBOX_WORKDIR,
    Registry,
    busybox_layout,
    local_registry,
)
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(900)]

USER, PASSWORD = "alice", "pw-" + uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def sdk(module_sdk: ServerProcess) -> ServerProcess:
    return module_sdk


@pytest.fixture(scope="module")
def registries(sdk, tmp_path_factory) -> Iterator[tuple[Registry, Registry]]:
    """(anonymous, htpasswd) registries, the busybox image pushed to both as bb:1."""
    layout = busybox_layout(sdk.settings.cache_dir)
    root = tmp_path_factory.mktemp("registries")
    with local_registry(root / "anon") as anon, \
            local_registry(root / "auth", credentials=(USER, PASSWORD)) as auth:
        anon.push(layout, "bb:1")
        auth.push(layout, "team/bb:1")
        yield anon, auth


@pytest.fixture(scope="module")
def busybox_template(registries) -> str:
    anon, _ = registries
    name = f"e2e-bb-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_image(f"{anon.host}/bb:1")
                   .run_cmd("echo built-on-top > /srv/built"), name)
    return name


def test_a_busybox_image_becomes_a_sandbox_with_its_files_env_and_shell(
        busybox_template) -> None:
    sbx = Sandbox.create(busybox_template)
    try:
        out = sbx.commands.run("cat /srv/marker /srv/built; echo $FOO; pwd; id -un; "
                               "[ -e /bin/bash ] || echo no-bash; "
                               "env | grep -c -E '^(LD_LIBRARY_PATH|PYTHONHOME|PYTHONPATH)=' "
                               "|| true")
        assert out.stdout.splitlines() == [
            BUSYBOX_MARKER.strip(), "built-on-top", "from-image", BUSYBOX_WORKDIR, "user",
            "no-bash", "0"]
        sbx.files.write("/home/user/note.txt", "written through envd")
        assert sbx.files.read("/home/user/note.txt") == "written through envd"
        assert {e.name for e in sbx.files.list("/bin")} >= {"busybox", "sh"}
        with pytest.raises(CommandExitException):
            sbx.commands.run("python3 -c 1")  # the image has no Python; envd brings its own
    finally:
        sbx.kill()


def test_credentials_pull_from_a_registry_that_requires_them(registries) -> None:
    _, auth = registries
    name = f"e2e-bbauth-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_image(f"{auth.host}/team/bb:1", username=USER,
                                         password=PASSWORD), name)
    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run("cat /srv/marker").stdout == BUSYBOX_MARKER
    finally:
        sbx.kill()


@pytest.mark.parametrize(("which", "image", "creds", "words"), [
    ("auth", "team/bb:1", (USER, "wrong"), "credentials"),
    ("auth", "team/bb:1", None, "requires a username and password"),
    ("anon", "bb:nope", None, "not found"),
    ("anon", "nothing/here:1", None, "not found"),
])
def test_pull_failures_are_build_errors_that_say_why(registries, which, image, creds,
                                                     words) -> None:
    registry = registries[0] if which == "anon" else registries[1]
    t = Template().from_image(f"{registry.host}/{image}",
                              **({"username": creds[0], "password": creds[1]} if creds else {}))
    with pytest.raises(BuildException) as e:
        Template.build(t, f"e2e-bbfail-{uuid.uuid4().hex[:8]}")
    assert words in str(e.value).lower()
    assert PASSWORD not in str(e.value) and "wrong" not in str(e.value)
