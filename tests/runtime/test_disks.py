"""Per-sandbox disks: copy-on-write over a shared base, never a copy of it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.storage import disks
from aenv.storage.disks import DiskError, create_disk, probe_method

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root")
QEMU_IO = shutil.which("qemu-io")


def make_base(path: Path, size: int = 4 << 20) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def qemu_io(image: Path, command: str) -> bool:
    """Run one qemu-io command on a qcow2 image; False when it fails (e.g. a pattern check)."""
    assert QEMU_IO, "qemu-io comes with qemu-utils"
    return subprocess.run([QEMU_IO, "-f", "qcow2", "-c", command, str(image)],
                          capture_output=True, check=False).returncode == 0


def test_qcow2_overlay_reads_the_base_and_keeps_writes_to_itself(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"\x5a" * (4 << 20))
    disk = create_disk(base, tmp_path / "vm", method="qcow2")
    assert (disk.path.name, disk.format, disk.method) == ("rootfs.qcow2", "qcow2", "qcow2")
    assert os.path.getsize(disk.path) < 1 << 20  # metadata only, no copy of the 4 MiB
    assert qemu_io(disk.path, "read -P 0x5a 0 1M")
    assert qemu_io(disk.path, "write -P 0xab 0 4096")
    assert base.read_bytes() == b"\x5a" * (4 << 20)
    assert qemu_io(disk.path, "read -P 0xab 0 4096")
    assert not qemu_io(disk.path, "read -P 0x5a 0 4096")  # the pattern check can fail


def test_create_disk_refuses_to_overwrite(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    make_base(base, 4096)
    (tmp_path / "d.qcow2").write_bytes(b"mine")
    with pytest.raises(DiskError, match="already exists"):
        create_disk(base, tmp_path, "d", method="qcow2")
    assert (tmp_path / "d.qcow2").read_bytes() == b"mine"
    with pytest.raises(DiskError, match="does not exist"):
        create_disk(tmp_path / "nope.raw", tmp_path)


def test_ext4_gets_qcow2_overlays(tmp_path: Path) -> None:
    if disks._fstype(tmp_path) != "ext4":
        pytest.skip("tmp is not on ext4")
    assert probe_method(tmp_path, tmp_path) == "qcow2"


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    """A small reflink-capable XFS on a loop device, torn down whatever happens."""
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("xfsprogs not installed")
    img, mnt = tmp_path / "xfs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(320 << 20)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)  # detaches the autoclear loop device


@as_root
def test_xfs_gets_reflinks_that_share_blocks_until_written(xfs: Path) -> None:
    base = xfs / "images" / "base.raw"
    base.parent.mkdir()
    data = make_base(base, 16 << 20)
    os.sync()
    free_before = os.statvfs(xfs).f_bfree
    assert probe_method(base.parent, xfs / "vms") == "reflink"
    disk = create_disk(base, xfs / "vms" / "a")
    assert (disk.path.name, disk.format, disk.method) == ("rootfs.raw", "raw", "reflink")
    os.sync()
    blocks = os.statvfs(xfs).f_frsize
    assert (free_before - os.statvfs(xfs).f_bfree) * blocks < 1 << 20  # no 16 MiB copy
    assert disk.path.read_bytes() == data
    with open(disk.path, "r+b") as f:
        f.write(b"\xab" * 4096)
    assert base.read_bytes() == data
    assert disk.path.read_bytes()[:4096] == b"\xab" * 4096


def test_doctor_reports_the_mechanism_of_the_data_dir(tmp_path: Path) -> None:
    [(check, result)] = disks.doctor_checks(tmp_path)
    assert check == "sandbox disks"
    assert result.startswith(probe_method(tmp_path, tmp_path))


def test_overlays_after_the_first_are_copies_made_without_qemu_img(tmp_path: Path,
                                                                    monkeypatch) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(b"\0" * (1 << 20))
    first = create_disk(base, tmp_path / "vms/a", method="qcow2")
    monkeypatch.setattr(disks.shutil, "which", lambda _: None)  # qemu-img now "missing"
    second = create_disk(base, tmp_path / "vms/b", method="qcow2")
    assert first.path.read_bytes() == second.path.read_bytes()
    info = subprocess.run(["qemu-img", "info", "--output=json", second.path],
                          capture_output=True, text=True, check=True).stdout
    assert str(base.resolve()) in info


def test_disks_made_at_once_over_a_new_base_run_qemu_img_once(tmp_path: Path,
                                                               monkeypatch) -> None:
    """A fork's children all make their disk over the fork's new capture at the same time:
    the empty overlay is made by one of them, the others wait and copy it (before, each
    of 16 children could spawn its own qemu-img: 9-16 runs, 215 ms wall at load ~12)."""
    from concurrent.futures import ThreadPoolExecutor

    base = tmp_path / "snap" / "rootfs.qcow2"
    base.parent.mkdir()
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"], check=True)
    runs = []
    real = disks.run

    def counted(argv, *a, **kw):
        runs.append(argv)
        return real(argv, *a, **kw)

    monkeypatch.setattr(disks, "run", counted)
    with ThreadPoolExecutor(16) as pool:
        made = list(pool.map(lambda i: create_disk(base, tmp_path / "vms" / f"c{i}"),
                             range(16)))
    assert len(runs) == 1
    assert len({d.path.read_bytes() for d in made}) == 1
