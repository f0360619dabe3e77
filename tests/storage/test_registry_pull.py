"""Pulls from a real docker-registry on loopback (images pushed by skopeo): layers land in
the blob cache verified, a warm pull transfers nothing, errors are named."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.storage import tar_layers
from aenv.storage.registry import pull_image
from aenv.storage.registry_auth import RegistryCredentials
from aenv.storage.registry_errors import AuthFailed, DigestMismatch, ImageNotFound, NoPlatform
from tests.registries import AuthRegistry, Registry, oci_layout, tar_layer

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/docker-registry"),
                                reason="needs docker-registry and skopeo (scripts/setup.sh)")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("registry"))
    yield r
    r.stop()


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "home")


@pytest.fixture(scope="module")
def whiteout_image(registry, tmp_path_factory) -> str:
    lower = tar_layer({"etc/a": b"a", "etc/b": b"b", "data/old/x": b"x"})
    upper = tar_layer({"etc/.wh.a": b"", "data/old/.wh..wh..opq": b"", "data/old/new": b"n",
                       "z/zstd": b"z"}, compress="zstd")
    layout = oci_layout(tmp_path_factory.mktemp("oci") / "two", [(lower, "gzip"),
                                                                  (upper, "zstd")])
    return registry.push(layout, "test/two")


def test_a_pull_applies_gzip_and_zstd_layers_with_whiteouts(settings, whiteout_image,
                                                              tmp_path) -> None:
    with pull_image(settings, whiteout_image) as image:
        assert len(image.layers) == 2 and image.bytes_transferred > 0
        assert image.layer_media_types[1].endswith("+zstd")
        tree = tmp_path / "tree"
        tree.mkdir()
        for layer in image.layers:
            tar_layers.apply_layer(tree, layer, whiteouts=True)
    assert not (tree / "etc/a").exists() and (tree / "etc/b").read_bytes() == b"b"
    assert not (tree / "data/old/x").exists() and (tree / "data/old/new").read_bytes() == b"n"
    assert (tree / "z/zstd").read_bytes() == b"z"


def test_a_warm_pull_transfers_no_blob_bytes(settings, whiteout_image) -> None:
    with pull_image(settings, whiteout_image) as cold:
        assert cold.bytes_transferred > 0
    with pull_image(settings, whiteout_image) as warm:
        assert warm.bytes_transferred == 0 and warm.digest == cold.digest


def test_a_digest_reference_with_cached_manifests_needs_no_registry(settings,
                                                                     whiteout_image) -> None:
    with pull_image(settings, whiteout_image) as image:
        digest = image.digest
    dead = f"127.0.0.1:1/test/two@{digest}"  # nothing listens on port 1
    with pull_image(settings, dead) as again:
        assert again.digest == digest and again.bytes_transferred == 0


def test_a_missing_tag_is_image_not_found(settings, registry, whiteout_image) -> None:
    ref = f"{registry.host}/test/two:nope"
    with pytest.raises(ImageNotFound, match="not found in the registry"), \
            pull_image(settings, ref):
        pass


def test_an_arm64_only_image_is_no_platform(settings, registry, tmp_path) -> None:
    layout = oci_layout(tmp_path / "arm", [(tar_layer({"f": b"arm"}), "gzip")], arch="arm64")
    ref = registry.push(layout, "test/arm")
    with pytest.raises(NoPlatform, match="linux/arm64"), pull_image(settings, ref):
        pass


def test_a_tampered_blob_is_a_digest_mismatch(settings, registry, tmp_path) -> None:
    data = tar_layer({"unique": os.urandom(4096)})
    layout = oci_layout(tmp_path / "t", [(data, "gzip")])
    ref = registry.push(layout, "test/tamper")
    blob = registry.blob_file("sha256:" + hashlib.sha256(data).hexdigest())
    blob.write_bytes(bytes(len(data)))
    with pytest.raises(DigestMismatch, match="does not match its digest"), \
            pull_image(settings, ref):
        pass
    leftovers = list(Path(settings.registry_blobs_dir / "tmp").iterdir())
    assert leftovers == []


def test_collection_keeps_the_cache_under_its_bound(tmp_path, registry, whiteout_image
                                                     ) -> None:
    big = tar_layer({"big": os.urandom(3 << 20)})
    ref = registry.push(oci_layout(tmp_path / "big", [(big, "gzip")]), "test/big")
    s = Settings(home=tmp_path / "home", layer_cache_mb=2)
    with pull_image(s, ref):
        pass  # the 3 MiB layer is pinned while in use, then collected after
    with pull_image(s, whiteout_image):
        pass
    from aenv.storage.blob_cache import BlobCache
    assert BlobCache(s.registry_blobs_dir, 2 << 20).size() <= 2 << 20


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    r = AuthRegistry(tmp_path_factory.mktemp("authreg"), "bob", "pa55-" + "x" * 20)
    yield r
    r.stop()


def test_basic_auth_over_tls_with_the_registry_ca(auth_registry, tmp_path, caplog) -> None:
    layout = oci_layout(tmp_path / "p", [(tar_layer({"private": b"p"}), "gzip")])
    ref = auth_registry.push(layout, "team/private")
    s = Settings(home=tmp_path / "home", registry_ca=auth_registry.ca)
    caplog.set_level(logging.DEBUG)
    creds = RegistryCredentials("bob", auth_registry.password)
    with pull_image(s, ref, credentials=creds) as image:
        assert len(image.layers) == 1
    assert auth_registry.password not in caplog.text
    for path in s.cache_dir.rglob("*"):
        if path.is_file():
            assert auth_registry.password.encode() not in path.read_bytes()
    wrong = RegistryCredentials("bob", "wrong")
    with pytest.raises(AuthFailed, match="refused the credentials"), \
            pull_image(s, ref.replace("latest", "other"), credentials=wrong):
        pass
    with pytest.raises(AuthFailed, match="requires a username and password"), \
            pull_image(s, ref.replace("latest", "other")):
        pass
