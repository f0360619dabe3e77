"""Images from a directory, a rootfs tarball, an OCI layout and a docker-save archive."""

from __future__ import annotations

import os
import time

import pytest

from aenv.guest import base as recipe
from aenv.storage import ext4
from aenv.storage.images import (
    build_image,
    find_image,
    list_images,
    remove_image,
    superseded_images,
)
from tests.storage.conftest import ext4_cat, ext4_exists, ext4_owner_mode
from tests.storage.layertools import docker_save, layer, oci_layout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="image builds need root")

SMALL = 32 * ext4.MiB


def _tree(tmp_path):
    src = tmp_path / "src"
    (src / "home/user").mkdir(parents=True)
    (src / "home/user/notes").write_text("hello")
    os.chown(src / "home/user", 1000, 1000)
    os.chown(src / "home/user/notes", 1000, 1000)
    os.chmod(src / "home/user/notes", 0o640)
    (src / "bin").mkdir()
    (src / "bin/tool").write_text("#!/bin/sh\n")
    os.chmod(src / "bin/tool", 0o4755)
    os.symlink("bin/tool", src / "tool-link")
    return src


def test_directory_image_keeps_contents_ownership_and_modes(settings, tmp_path):
    image = build_image(settings, "d", _tree(tmp_path), guest_layer=False, size_bytes=SMALL)
    assert ext4_cat(image.path, "/home/user/notes") == b"hello"
    assert ext4_owner_mode(image.path, "/home/user/notes") == (1000, 1000, 0o640)
    assert ext4_owner_mode(image.path, "/bin/tool") == (0, 0, 0o4755)
    assert image.size_bytes == SMALL == os.path.getsize(image.path)


def test_building_the_same_directory_twice_is_a_cache_hit(settings, tmp_path):
    src = _tree(tmp_path)
    first = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    mtime = os.stat(first.path).st_mtime_ns
    t0 = time.monotonic()
    second = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    assert second == first
    assert os.stat(second.path).st_mtime_ns == mtime
    assert time.monotonic() - t0 < 2.0


def test_changing_one_byte_of_the_source_changes_the_digest(settings, tmp_path):
    src = _tree(tmp_path)
    first = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    (src / "home/user/notes").write_text("hellO")
    second = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    assert second.digest != first.digest
    assert ext4_cat(second.path, "/home/user/notes") == b"hellO"


def test_rootfs_tarball_becomes_an_image(settings, tmp_path):
    tarball = tmp_path / "rootfs.tar.gz"
    tarball.write_bytes(layer([{"name": "etc", "type": "dir"},
                               {"name": "etc/os-release", "data": b"ID=test\n", "uid": 7}]))
    image = build_image(settings, "t", tarball, guest_layer=False, size_bytes=SMALL)
    assert ext4_cat(image.path, "/etc/os-release") == b"ID=test\n"
    assert ext4_owner_mode(image.path, "/etc/os-release")[0] == 7


def _layers():
    lower = layer([
        {"name": "etc", "type": "dir"},
        {"name": "etc/removed", "data": b"lower"},
        {"name": "etc/changed", "data": b"lower"},
        {"name": "var/cache", "type": "dir"},
        {"name": "var/cache/old", "data": b"lower"},
        {"name": "usr/lib", "type": "dir"},
        {"name": "lib", "type": "symlink", "target": "usr/lib"},
    ])
    upper = layer([
        {"name": "etc/.wh.removed"},
        {"name": "etc/changed", "data": b"upper", "uid": 1000, "gid": 1000},
        {"name": "var/cache", "type": "dir"},
        {"name": "var/cache/.wh..wh..opq"},
        {"name": "var/cache/new", "data": b"upper"},
        {"name": "lib/through-link", "data": b"via symlink"},
    ])
    return [lower, upper]


def _check_layered(path):
    assert not ext4_exists(path, "/etc/removed")
    assert ext4_cat(path, "/etc/changed") == b"upper"
    assert ext4_owner_mode(path, "/etc/changed")[:2] == (1000, 1000)
    assert not ext4_exists(path, "/var/cache/old")
    assert ext4_cat(path, "/var/cache/new") == b"upper"
    assert ext4_cat(path, "/usr/lib/through-link") == b"via symlink"
    assert not ext4_exists(path, "/etc/.wh.removed")


def test_oci_layout_layers_apply_in_order_with_whiteouts(settings, tmp_path):
    layout = oci_layout(tmp_path / "layout", _layers())
    image = build_image(settings, "oci", layout, guest_layer=False, size_bytes=SMALL)
    _check_layered(image.path)


def test_docker_save_archive_layers_apply_in_order_with_whiteouts(settings, tmp_path):
    archive = docker_save(tmp_path / "img.tar", _layers())
    image = build_image(settings, "saved", archive, guest_layer=False, size_bytes=SMALL)
    _check_layered(image.path)


def test_oci_archive_of_a_layout_is_read_like_the_layout(settings, tmp_path):
    import tarfile

    layout = oci_layout(tmp_path / "layout", _layers())
    archive = tmp_path / "layout.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("oci-layout", "index.json", "blobs"):
            tar.add(layout / name, arcname=name)
    image = build_image(settings, "ociarch", archive, guest_layer=False, size_bytes=SMALL)
    _check_layered(image.path)


def test_images_are_listed_and_found_by_name(settings, tmp_path):
    image = build_image(settings, "named", _tree(tmp_path), guest_layer=False, size_bytes=SMALL)
    assert [i.digest for i in list_images(settings)] == [image.digest]
    assert find_image(settings, "named") == image
    assert find_image(settings, image.digest[:12]) == image


def test_small_trees_get_the_default_size(tmp_path):
    assert ext4.default_size(_tree(tmp_path)) == ext4.DEFAULT_SIZE


def test_big_trees_get_a_quarter_more_plus_free_space(monkeypatch, tmp_path):
    monkeypatch.setattr(ext4, "tree_size", lambda _: 8 * ext4.GiB)
    size = ext4.default_size(tmp_path)
    assert size >= 10 * ext4.GiB + ext4.MIN_FREE
    assert size % (64 * ext4.MiB) == 0


def test_envd_code_change_changes_the_guest_layer_digest(monkeypatch, tmp_path):
    before = recipe.guest_layer_digest()
    sources = recipe.envd_sources()
    host, guest = sources[-1]
    copy = tmp_path / "copy.py"
    copy.write_bytes(host.read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(recipe, "envd_sources", lambda: [*sources[:-1], (copy, guest)])
    assert recipe.guest_layer_digest() != before


def test_envd_requirements_are_the_envd_group_of_pyproject():
    reqs = recipe.envd_requirements()
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}
    assert {"starlette", "uvicorn", "connectrpc"} <= names
    assert "pyroute2" not in names and "typer" not in names


def test_only_older_images_of_a_name_are_superseded(settings, tmp_path):
    src = _tree(tmp_path)
    old = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    (src / "extra").write_text("x")
    new = build_image(settings, "d", src, guest_layer=False, size_bytes=SMALL)
    other = build_image(settings, "other", src, guest_layer=False, size_bytes=SMALL)
    assert superseded_images(settings) == [old]
    remove_image(settings, old)
    assert {i.digest for i in list_images(settings)} == {new.digest, other.digest}
