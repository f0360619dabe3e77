"""State files reach the disk before their names do (``aenv.storage.durable``).

A power loss cannot be staged here, so these tests record what the kernel is asked: every
``fsync`` (by inode, read from the descriptor when it is called) and every rename. The
claim checked is the ordering a crash-safe commit needs: each file's data is flushed before
the rename that makes it visible, and the directory holding the new name afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aenv.storage import disk_layers, durable, snapshot_store
from aenv.storage import snapshots as snap
from aenv.storage.disks import Disk


@pytest.fixture
def journal(monkeypatch):
    """``[("fsync", inode) | ("rename", dst)]`` in call order."""
    events: list[tuple[str, object]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def rename(src, dst, *a, **kw) -> None:
        real_rename(src, dst, *a, **kw)
        events.append(("rename", Path(dst)))

    def replace(src, dst, *a, **kw) -> None:
        real_replace(src, dst, *a, **kw)
        events.append(("rename", Path(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return events


def flushed_before(events, inode: int, target: Path) -> bool:
    """Was ``inode`` fsynced before ``target`` was renamed into place?"""
    renamed = next(i for i, e in enumerate(events) if e == ("rename", target))
    return ("fsync", inode) in events[:renamed]


def flushed_after(events, inode: int, target: Path) -> bool:
    renamed = next(i for i, e in enumerate(events) if e == ("rename", target))
    return ("fsync", inode) in events[renamed:]


def test_a_snapshot_commit_flushes_files_then_names(tmp_path, journal) -> None:
    directory = tmp_path / "snapshots" / "s1"
    staging = snap.begin(directory)
    (staging / snap.DEVICE_STATE).write_bytes(b"device state")
    (staging / snap.MEMORY).write_bytes(b"\1" * 8192)
    manifest = snap.Manifest(driver="t", vm={}, memory_size=8192,
                             layers=(snap.MemoryLayer(directory, "full", 2),), drives=())
    snap.commit(staging, directory, manifest)
    for name in (snap.DEVICE_STATE, snap.MEMORY, snap.MANIFEST):
        assert flushed_before(journal, (directory / name).stat().st_ino, directory), name
    assert flushed_before(journal, directory.stat().st_ino, directory)  # its entries
    assert flushed_after(journal, directory.parent.stat().st_ino, directory)  # its name


def test_a_disk_snapshot_is_flushed_before_it_is_named(tmp_path, journal) -> None:
    disk = tmp_path / "vm" / "rootfs.raw"
    disk.parent.mkdir()
    disk.write_bytes(b"files" * 100)
    directory = tmp_path / "snapshots" / "d1"
    snapshot_store.save_disk(Disk(disk, "raw", "reflink", disk), directory)
    assert disk.exists()  # linked, the VM's name stays until the caller removes it
    for name in ("rootfs.raw", snapshot_store.DISK_MANIFEST):
        assert flushed_before(journal, (directory / name).stat().st_ino, directory), name
    assert flushed_after(journal, directory.parent.stat().st_ino, directory)


def test_a_layer_is_flushed_before_its_metadata_names_it(tmp_path, journal) -> None:
    disk = tmp_path / "vm" / "rootfs.qcow2"
    disk.parent.mkdir()
    disk.write_bytes(b"qcow2 bytes")
    layers = tmp_path / "layers"
    disk_layers.commit(Disk(disk, "qcow2", "qcow2", tmp_path / "base.raw"), layers, "l1")
    meta = layers / "l1.json"
    assert flushed_before(journal, (layers / "l1.qcow2").stat().st_ino, meta)
    assert flushed_after(journal, layers.stat().st_ino, meta)
    assert json.loads(meta.read_text())["id"] == "l1"


def test_write_atomic_never_leaves_a_short_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "key"
    durable.write_atomic(path, b"old contents", mode=0o600)

    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        durable.write_atomic(path, b"new")
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_compacted_drive_file_is_flushed_before_it_replaces_the_old_one(
        tmp_path, journal) -> None:
    from aenv.runtime import qemu_snapshot
    from tests.runtime.test_compaction import MAX_CHAIN, _chain

    _, dirs = _chain(tmp_path, 4)
    top = dirs[-1]
    job = qemu_snapshot.prepare_compaction(top, MAX_CHAIN)
    assert job is not None
    flat = (top / ".rootfs.qcow2.compacting").stat().st_ino
    assert job.install()
    drive = top / "rootfs.qcow2"
    assert drive.stat().st_ino == flat
    assert flushed_before(journal, flat, drive)
    assert flushed_after(journal, top.stat().st_ino, drive)  # the new name
    job.release()
    manifest = top / snap.MANIFEST
    assert flushed_before(journal, manifest.stat().st_ino, manifest)
    assert flushed_after(journal, top.stat().st_ino, manifest)


def test_start_writeback_leaves_the_data_as_written(tmp_path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"\7" * 65536, 4096)
        durable.start_writeback(fd, 4096, 65536)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(4096) + b"\7" * 65536
