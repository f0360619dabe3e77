"""Templates from the kinds of registry image issue 17 names, through E2B's SDK, against one
real ``docker-registry`` on loopback (images pushed with skopeo):

- a Debian minbase without Python (``debootstrap --variant=minbase``, cached under the cache
  dir): commands run with the image's bash, as its user or root, and files, PTY and
  ``watch_dir`` behave as in ``base``, while ``python3`` is absent;
- an image whose upper layer deletes a lower layer's file (a whiteout) and makes a directory
  opaque: the sandbox sees neither the file nor the directory's old entries;
- an image index with an arm64 entry listed before the amd64 one: the build takes the amd64
  image (its marker file); an index without amd64 is a build error naming what it has;
- ``Template().from_dockerfile`` whose ``FROM`` names an image in the registry, with ``ENV``
  and ``RUN`` on top.

Each template is built once per module (a build cold-boots a VM) and shared by its tests.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize

from tests.local_registry import (
    BUSYBOX_MARKER,
    DEBIAN_ENV,
    Registry,
    busybox_layout,
    debian_layout,
    local_registry,
)
from tests.registries import oci_index_layout, oci_layout, tar_layer
from tests.sdk_checks import assert_watch_sees_a_new_file
from tests.server.conftest import ServerProcess

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def sdk(module_sdk: ServerProcess) -> ServerProcess:
    return module_sdk


@pytest.fixture(scope="module")
def registry(sdk: ServerProcess, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Registry]:
    with local_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


def _build(template: Template, kind: str) -> str:
    name = f"e2e-{kind}-{uuid.uuid4().hex[:8]}"
    Template.build(template, name)
    return name


@pytest.fixture(scope="module")
def busybox_layer(sdk: ServerProcess) -> tuple[bytes, str]:
    """The busybox image's one layer (gzip), a base for the layered images below."""
    layout = busybox_layout(sdk.settings.cache_dir)
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].split(":")[1]).read_bytes())
    (layer,) = manifest["layers"]
    assert layer["mediaType"].endswith("tar+gzip")
    return (blobs / layer["digest"].split(":")[1]).read_bytes(), "gzip"


# -- a Debian minbase without Python ----------------------------------------------------------


@pytest.fixture(scope="module")
def debian_sbx(sdk: ServerProcess, registry: Registry) -> Iterator[Sandbox]:
    ref = registry.push(debian_layout(sdk.settings.cache_dir), "debian-minbase:12")
    sbx = Sandbox.create(_build(Template().from_image(ref), "debian"), timeout=900)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_debian_minbase_runs_commands_with_its_bash_and_has_no_python(
        debian_sbx: Sandbox) -> None:
    out = debian_sbx.commands.run(
        "readlink /proc/$$/exe; echo ${BASH_VERSION:+bash}; id -un; pwd; echo $LANG; "
        "cat /etc/debian_version; command -v python3 || echo no-python3; "
        "ls -d /usr/lib/python3* 2>/dev/null || echo no-python3-lib").stdout.splitlines()
    assert out[0] in ("/usr/bin/bash", "/bin/bash")
    # (the image's Env; its PATH is /etc/profile's for a login shell, as on E2B)
    assert out[1:5] == ["bash", "user", "/home/user", DEBIAN_ENV["LANG"]]
    assert out[5].startswith("12.")
    assert out[6:] == ["no-python3", "no-python3-lib"]
    with pytest.raises(CommandExitException) as e:
        debian_sbx.commands.run("python3 -c 'print(1)'")
    assert e.value.exit_code == 127  # the image's bash: command not found


def test_debian_minbase_runs_as_root_and_as_its_user(debian_sbx: Sandbox) -> None:
    assert debian_sbx.commands.run("id -u; touch /root/by-root && echo wrote",
                                   user="root").stdout.split() == ["0", "wrote"]
    with pytest.raises(CommandExitException):
        debian_sbx.commands.run("touch /root/by-user")  # the default user is not root


def test_debian_minbase_files_write_read_and_list(debian_sbx: Sandbox) -> None:
    debian_sbx.files.write("/home/user/notes/a.txt", "written through envd\n")
    assert debian_sbx.files.read("/home/user/notes/a.txt") == "written through envd\n"
    assert [e.name for e in debian_sbx.files.list("/home/user/notes")] == ["a.txt"]
    assert debian_sbx.commands.run(
        "cat notes/a.txt; stat -c %U notes/a.txt", cwd="/home/user"
    ).stdout.splitlines() == ["written through envd", "user"]


def test_debian_minbase_pty_runs_its_bash(debian_sbx: Sandbox) -> None:
    handle = debian_sbx.pty.create(PtySize(rows=24, cols=80))
    debian_sbx.pty.send_stdin(
        handle.pid, b"echo pty-$((6*7)) $(tr '\\0' ' ' </proc/$$/cmdline)\nexit 3\n")
    out = bytearray()
    with pytest.raises(CommandExitException) as e:
        handle.wait(on_pty=out.extend)
    assert e.value.exit_code == 3
    text = out.decode(errors="replace")
    assert "pty-42 /bin/bash -i -l" in text


def test_debian_minbase_watch_dir_sees_a_new_file(debian_sbx: Sandbox) -> None:
    assert_watch_sees_a_new_file(debian_sbx, within=15)


# -- whiteouts and opaque directories ---------------------------------------------------------


def test_a_whiteout_in_the_upper_layer_hides_the_lower_layers_file(
        registry: Registry, busybox_layer: tuple[bytes, str], tmp_path: Path) -> None:
    lower = tar_layer({"data/gone": b"deleted above\n", "data/kept": b"kept\n",
                       "data/opaque/old": b"hidden by the opaque marker\n"})
    upper = tar_layer({"data/.wh.gone": b"", "data/opaque/.wh..wh..opq": b"",
                       "data/opaque/new": b"new\n"}, compress="zstd")
    layout = oci_layout(tmp_path / "layered", [busybox_layer, (lower, "gzip"),
                                                (upper, "zstd")])
    name = _build(Template().from_image(registry.push(layout, "layered:1")), "layered")
    sbx = Sandbox.create(name)
    try:
        out = sbx.commands.run("ls -a /data /data/opaque; cat /data/kept /data/opaque/new")
        assert out.stdout.split() == [
            "/data:", ".", "..", "kept", "opaque",
            "/data/opaque:", ".", "..", "new",
            "kept", "new"]
    finally:
        sbx.kill()


# -- an image index ---------------------------------------------------------------------------


def test_an_image_index_gives_the_amd64_image(
        registry: Registry, busybox_layer: tuple[bytes, str], tmp_path: Path) -> None:
    # arm64 first: a builder that took the index's first entry would show "arm64".
    layout = oci_index_layout(tmp_path / "multi", [
        (arch, [busybox_layer, (tar_layer({"srv/arch": f"{arch}\n".encode()}), "gzip")])
        for arch in ("arm64", "amd64")])
    name = _build(Template().from_image(registry.push(layout, "multi:1")), "multi")
    sbx = Sandbox.create(name)
    try:
        assert sbx.commands.run("cat /srv/arch").stdout == "amd64\n"
    finally:
        sbx.kill()


def test_an_index_without_amd64_is_a_build_error_that_names_its_platforms(
        registry: Registry, busybox_layer: tuple[bytes, str], tmp_path: Path) -> None:
    layout = oci_index_layout(tmp_path / "no-amd64", [
        (arch, [busybox_layer]) for arch in ("arm64", "s390x")])
    ref = registry.push(layout, "no-amd64:1")
    with pytest.raises(BuildException) as e:
        _build(Template().from_image(ref), "noamd64")
    message = str(e.value)
    assert "linux/amd64" in message
    assert "linux/arm64" in message and "linux/s390x" in message


# -- a Dockerfile FROM a registry image -------------------------------------------------------


def test_a_dockerfile_from_a_registry_image_with_env_and_run(
        sdk: ServerProcess, registry: Registry) -> None:
    ref = registry.push(busybox_layout(sdk.settings.cache_dir), "bb:1")
    dockerfile = (f"FROM {ref}\n"
                  "ENV GREETING=from-the-dockerfile\n"
                  "RUN echo \"$GREETING ran\" > /srv/ran\n")
    name = _build(Template().from_dockerfile(dockerfile), "dockerfile")
    sbx = Sandbox.create(name)
    try:
        out = sbx.commands.run("cat /srv/marker /srv/ran; echo $GREETING $FOO")
        assert out.stdout.splitlines() == [
            BUSYBOX_MARKER.strip(), "from-the-dockerfile ran", "from-the-dockerfile from-image"]
    finally:
        sbx.kill()
