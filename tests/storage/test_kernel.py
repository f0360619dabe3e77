"""Kernel preparation: module load order, the initramfs, and the real Debian cloud kernel."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time

import pytest

from aenv.config import Settings
from aenv.storage import vmlinux
from aenv.storage.errors import KernelError
from aenv.storage.kernel import (
    MANIFEST,
    ModuleTree,
    ensure_kernel,
    initramfs,
    initramfs_recipe,
    list_kernels,
)


def _module_tree(tmp_path, deps: dict[str, str], builtin=()):
    root = tmp_path / "6.1.0-test"
    (root / "kernel/drivers").mkdir(parents=True)
    for name, depends in deps.items():
        (root / "kernel/drivers" / f"{name.replace('_', '-')}.ko").write_bytes(
            b"\x7fELF junk\0license=GPL\0depends=" + depends.encode() + b"\0name=x\0"
        )
    (root / "modules.builtin").write_text("".join(f"kernel/fs/{b}.ko\n" for b in builtin))
    return ModuleTree(root)


def test_dependencies_are_loaded_before_the_modules_that_need_them(tmp_path):
    tree = _module_tree(tmp_path, {
        "virtio_ring": "", "virtio": "virtio_ring", "virtio_net": "virtio,net_failover",
        "net_failover": "failover", "failover": "",
    })
    assert tree.load_order(["virtio_net"]) == [
        "virtio_ring", "virtio", "failover", "net_failover", "virtio_net"
    ]


def test_builtin_modules_are_left_out(tmp_path):
    tree = _module_tree(tmp_path, {"virtio_blk": ""}, builtin=["ext4"])
    assert tree.load_order(["ext4", "virtio_blk"]) == ["virtio_blk"]


def test_a_missing_module_is_named(tmp_path):
    tree = _module_tree(tmp_path, {"virtio": "virtio_ring"})
    with pytest.raises(KernelError, match="virtio_ring"):
        tree.load_order(["virtio"])


def test_initramfs_holds_init_busybox_and_modules_in_order(tmp_path):
    data = initramfs(busybox=b"BB", modules=[("b_mod", b"B"), ("a_mod", b"A")])
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["cpio", "-idm", "--quiet"], input=gzip.decompress(data), cwd=out, check=True)
    assert (out / "etc/aenv-modules").read_text() == "b_mod\na_mod\n"
    assert (out / "lib/modules/a_mod.ko").read_bytes() == b"A"
    assert os.readlink(out / "bin/switch_root") == "busybox"
    assert (out / "init").read_bytes().startswith(b"#!/bin/sh")
    assert os.access(out / "init", os.X_OK)


@pytest.fixture(scope="module")
def cloud_kernel():
    """The real Debian cloud kernel in the machine's aenv home (shared, cached)."""
    if os.geteuid() != 0:
        pytest.skip("kernel cache lives in the root-owned aenv home")
    return ensure_kernel(Settings.from_env(), "cloud")


def test_cloud_kernel_is_a_pvh_elf_with_an_initramfs_and_modules(cloud_kernel):
    assert cloud_kernel.flavor == "cloud"
    assert cloud_kernel.version.endswith("-cloud-amd64")
    assert vmlinux.has_pvh_note(cloud_kernel.vmlinux.read_bytes())
    assert cloud_kernel.initrd is not None
    assert gzip.decompress(cloud_kernel.initrd.read_bytes())[:6] == b"070701"
    assert (cloud_kernel.modules / "kernel/fs/overlayfs/overlay.ko").is_file()


def test_a_prepared_kernel_is_returned_from_the_cache(cloud_kernel):
    t0 = time.monotonic()
    again = ensure_kernel(Settings.from_env(), "cloud")
    assert again == cloud_kernel
    assert time.monotonic() - t0 < 0.5
    assert cloud_kernel in list_kernels(Settings.from_env())


def test_a_kernel_prepared_with_an_older_initramfs_gets_the_current_one(cloud_kernel, tmp_path):
    """An upgrade of aenv reaches kernels prepared before it: the initramfs is rewritten
    from the kept modules, the kernel and modules stay, and hard links to the old files
    (a copy made with cp -l, or a VM's working directory) keep the old contents."""
    real = Settings.from_env()
    old = Settings(home=tmp_path / "home", cache_home=tmp_path / "artifacts")
    copy = old.kernels_dir / cloud_kernel.directory.name
    copy.parent.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(cloud_kernel.directory), str(copy)], check=True)
    old.cache_dir.mkdir(parents=True)
    (old.cache_dir / "debs").symlink_to(real.cache_dir / "debs")  # busybox-static, offline
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["initrd_recipe"] = "an older aenv"
    (copy / MANIFEST).unlink()  # a new inode: the shared one is the real kernel's
    (copy / MANIFEST).write_text(json.dumps(manifest))
    (copy / "initrd.img").unlink()
    (copy / "initrd.img").write_bytes(b"old initramfs")

    kernel = ensure_kernel(old, "cloud")

    assert kernel.directory == copy and kernel.initrd_recipe == initramfs_recipe()
    assert gzip.decompress(kernel.initrd.read_bytes()) == gzip.decompress(
        cloud_kernel.initrd.read_bytes())
    assert json.loads((copy / MANIFEST).read_text())["built_at"] == manifest["built_at"]
    assert os.path.samefile(copy / "vmlinux", cloud_kernel.vmlinux)
    assert ensure_kernel(old, "cloud") == kernel  # and only once


def test_unknown_flavor_is_refused(settings):
    with pytest.raises(KernelError, match="flavor"):
        ensure_kernel(settings, "huge")
