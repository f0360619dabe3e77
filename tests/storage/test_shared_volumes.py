"""Volumes in the shared store (``aenv.storage.shared_volumes``) with two nodes' views of one
directory: records every node reads, names unique through the filesystem, the users files
behind a cluster-wide delete check, the content API's soft size limit, and (on an XFS
loop image mounted with ``prjquota``) the hard project quota."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.storage import shared_volumes as sv
from aenv.storage import volume_fs
from aenv.store.volumes import VolumeNameTaken

MIB = 1024 * 1024


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[sv.SharedVolumes, sv.SharedVolumes]:
    return sv.SharedVolumes(tmp_path, "n1"), sv.SharedVolumes(tmp_path, "n2")


def _ready(store: sv.SharedVolumes, name: str, size_mb: int = 16) -> str:
    rec = store.insert(name, size_mb)
    _, quota, project = store.make_root(rec.id, size_mb, owner=os.getuid())
    store.set_ready(rec.id, quota=quota, project=project)
    return rec.id


def test_a_volume_made_on_one_node_is_read_whole_on_another(
        nodes: tuple[sv.SharedVolumes, sv.SharedVolumes]) -> None:
    a, b = nodes
    made = a.insert("data", 64)
    assert b.get(made.id) is not None and b.get(made.id).state == "creating"  # type: ignore[union-attr]
    a.make_root(made.id, 64, owner=os.getuid())
    a.set_ready(made.id)
    seen = b.get(made.id)
    assert seen is not None and (seen.name, seen.token, seen.size_mb, seen.state) == (
        "data", made.token, 64, "ready")
    assert seen.token_matches(made.token)
    assert b.by_name("data") == seen and [r.id for r in b.list()] == [made.id]
    assert b.root(made.id).is_dir() and b.root(made.id) == a.root(made.id)
    assert b.quota(made.id) == "soft"
    raw = json.loads((a.base / "records" / f"{made.id}.json").read_text())
    assert raw["quota"] == "soft" and raw["size_mb"] == 64
    assert not list((a.base / "records").glob(".*"))   # no temporary file left behind


def test_a_name_is_held_by_one_volume_across_nodes(
        nodes: tuple[sv.SharedVolumes, sv.SharedVolumes]) -> None:
    a, b = nodes
    first = _ready(a, "shared-name")
    with pytest.raises(VolumeNameTaken):
        b.insert("shared-name", 16)
    assert a.delete(first) and not a.delete(first)
    a.remove_root(first)
    assert b.get(first) is None and b.by_name("shared-name") is None
    again = _ready(b, "shared-name")
    assert a.by_name("shared-name") is not None and a.by_name("shared-name").id == again  # type: ignore[union-attr]


def test_a_crashed_creates_claim_is_taken_back_only_when_stale(
        nodes: tuple[sv.SharedVolumes, sv.SharedVolumes]) -> None:
    a, b = nodes
    entry = a.base / "names" / "orphan"
    entry.write_text("vol_neverwritten0000000")
    with pytest.raises(VolumeNameTaken):
        b.insert("orphan", 16)
    old = time.time() - sv.CLAIM_STALE_S - 5
    os.utime(entry, (old, old))
    rec = b.insert("orphan", 16)
    assert entry.read_text() == rec.id
    # one that wrote its record but crashed before its volume was ready
    a.make_root(rec.id, 16, owner=os.getuid())
    with pytest.raises(VolumeNameTaken):
        a.insert("orphan", 16)
    os.utime(entry, (old, old))
    again = a.insert("orphan", 16)
    assert b.get(rec.id) is None and not (a.base / "data" / rec.id).exists()
    assert b.by_name("orphan") is not None and b.by_name("orphan").id == again.id  # type: ignore[union-attr]
    a.set_ready(again.id)
    os.utime(entry, (old, old))
    with pytest.raises(VolumeNameTaken):   # a ready volume's name is never taken back
        b.insert("orphan", 16)


def test_a_delete_mark_hides_the_volume_until_it_ends_or_goes_stale(
        nodes: tuple[sv.SharedVolumes, sv.SharedVolumes]) -> None:
    a, b = nodes
    vid = _ready(a, "marked")
    assert a.begin_delete(vid)
    assert not b.begin_delete(vid)          # one delete at a time, cluster-wide
    assert b.get(vid) is None and b.by_name("marked") is None and b.list() == []
    a.end_delete(vid)
    assert b.get(vid) is not None
    assert a.begin_delete(vid)
    (a.base / "deleting" / vid).write_text(str(time.time() - sv.DELETE_STALE_S - 5))
    assert b.get(vid) is not None           # a crashed delete's mark
    assert b.begin_delete(vid)              # and a new delete replaces it


def test_users_of_fresh_nodes_count_and_a_silent_nodes_stop_counting(
        tmp_path: Path) -> None:
    a = sv.SharedVolumes(tmp_path, "n1")
    b = sv.SharedVolumes(tmp_path, "n2", users_stale_s=0.5)
    a.publish_users({"vol_x": ["s1", "s2"], "vol_y": []})
    assert b.users("vol_x") == ["s1 (node n1)", "s2 (node n1)"]
    assert b.users("vol_y") == [] and a.users("vol_x", other_nodes_only=True) == []
    time.sleep(0.7)
    assert b.users("vol_x") == []           # n1 has not written for longer than the bound
    a.publish_users({})
    assert b.users("vol_x") == []


def test_removing_a_volume_moves_its_files_out_then_deletes_them(
        nodes: tuple[sv.SharedVolumes, sv.SharedVolumes]) -> None:
    a, b = nodes
    vid = _ready(a, "gone")
    (a.root(vid) / "f").write_bytes(b"x" * 10000)
    assert b.used_bytes(vid) >= 10000
    b.remove_root(vid)
    assert not (a.base / "data" / vid).exists() and list((a.base / "trash").iterdir()) == []
    b.remove_root(vid)                      # twice is fine


def test_path_parts_that_are_not_one_component_are_refused(tmp_path: Path) -> None:
    store = sv.SharedVolumes(tmp_path, "n1")
    for bad in ("../x", "a/b", "..", ".hidden", ""):
        with pytest.raises(sv.SharedVolumeError):
            store.root(bad)
        assert store.get(bad) is None
    assert store.by_name("../records") is None


def test_uploads_over_a_soft_limit_are_refused_as_a_full_volume(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    vol = volume_fs.Volume(str(root), limit=MIB)
    up = vol.begin_write(["small.bin"])
    try:
        up.write(b"a" * (MIB // 2))
        up.commit(mode=None, uid=None, gid=None, force=False)
    finally:
        up.abort()
    up = vol.begin_write(["big.bin"])
    try:
        with pytest.raises(volume_fs.VolumeFull):
            up.write(b"b" * MIB)
    finally:
        up.abort()
    assert sorted(os.listdir(root)) == ["small.bin"]   # nothing half written
    (root / "fill").write_bytes(b"c" * MIB)            # a guest went over (soft)
    with pytest.raises(volume_fs.VolumeFull):
        vol.begin_write(["more.bin"])
    assert volume_fs.Volume(str(root)).begin_write(["free.bin"]).fd >= 0  # no limit: none


@contextlib.contextmanager
def _xfs_with_project_quotas(where: Path) -> Iterator[Path]:
    image, mnt = where / "xfs.img", where / "mnt"
    with open(image, "wb") as f:
        f.truncate(512 * MIB)   # XFS's smallest is 300 MiB
    subprocess.run(["mkfs.xfs", "-q", str(image)], check=True)
    mnt.mkdir()
    done = subprocess.run(["mount", "-o", "loop,prjquota", str(image), str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:   # e.g. a kernel without CONFIG_QUOTA (XFS says so in dmesg)
        pytest.skip(f"cannot mount XFS with prjquota here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
def test_on_xfs_with_prjquota_a_volumes_size_is_a_hard_limit(tmp_path: Path) -> None:
    if os.getuid() != 0 or shutil.which("mkfs.xfs") is None or shutil.which(
            "xfs_quota") is None:
        pytest.skip("needs root, mkfs.xfs and xfs_quota")
    with _xfs_with_project_quotas(tmp_path) as mnt:
        store = sv.SharedVolumes(mnt, "n1")
        assert sv.xfs_project_quotas(mnt)
        rec = store.insert("quota", 8)
        root, quota, project = store.make_root(rec.id, 8)
        store.set_ready(rec.id, quota=quota, project=project)
        assert (quota, store.quota(rec.id)) == ("xfs", "xfs") and project > 0
        st = os.statvfs(root)                 # the project's limit is what df shows
        assert st.f_blocks * st.f_frsize == 8 * MIB
        with pytest.raises(OSError) as e, open(root / "big", "wb") as f:
            for _ in range(16):
                f.write(b"z" * MIB)
                f.flush()
                os.fsync(f.fileno())
        assert e.value.errno in (28, 122)     # ENOSPC / EDQUOT: every writer meets it
        (root / "big").unlink()
        store.remove_root(rec.id)
        assert store.delete(rec.id)
    assert not sv.xfs_project_quotas(tmp_path)  # not XFS: soft
