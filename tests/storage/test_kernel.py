"""Kernel preparation: module load order, the initramfs, and the real Debian cloud kernel."""

from __future__ import annotations

import gzip
import os
import subprocess
import time

import pytest

from aenv.config import Settings
from aenv.storage import vmlinux
from aenv.storage.errors import KernelError
from aenv.storage.kernel import ModuleTree, ensure_kernel, initramfs, list_kernels


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


def test_unknown_flavor_is_refused(settings):
    with pytest.raises(KernelError, match="flavor"):
        ensure_kernel(settings, "huge")
