"""``benchmarks/vm_boot.py --server python``: the floor's files land in a copy of the image.

The boot itself is the benchmark's to measure; here: the copy leaves the image alone, the
init is executable and valid sh, the server is valid Python, and a debugfs failure is an
error rather than a disk that would boot into a kernel panic.
"""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import vm_boot
from tests.storage.conftest import ext4_cat, ext4_exists, ext4_owner_mode


@pytest.fixture
def image(tmp_path):
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/python3").write_text("")
    path = tmp_path / "rootfs.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(root), str(path), "16M"], check=True)
    path.chmod(0o444)
    return path


def test_the_floor_files_are_written_into_a_copy(image, tmp_path):
    before = image.read_bytes()
    disk = vm_boot.floor_disk(image, tmp_path / "vm")

    assert disk == tmp_path / "vm/rootfs.raw"
    assert image.read_bytes() == before
    assert not ext4_exists(image, vm_boot.FLOOR_INIT)
    init = ext4_cat(disk, vm_boot.FLOOR_INIT)
    server = ext4_cat(disk, vm_boot.FLOOR_SERVER)
    assert ext4_owner_mode(disk, vm_boot.FLOOR_INIT)[2] == 0o755
    assert f"python3 -S {vm_boot.FLOOR_SERVER}".encode() in init
    subprocess.run(["sh", "-n"], input=init, check=True)
    compile(server, vm_boot.FLOOR_SERVER, "exec")
    assert b'readuntil(b"\\r\\n\\r\\n")' in server


def test_a_debugfs_failure_is_an_error(image, tmp_path, monkeypatch):
    monkeypatch.setattr(vm_boot, "FLOOR_INIT", "/no/such/dir/init")
    with pytest.raises(RuntimeError, match="debugfs could not write"):
        vm_boot.floor_disk(image, tmp_path / "vm")
