"""What garbage collection keeps: what the roots' own manifests read, and nothing behind it."""

from __future__ import annotations

import json
from pathlib import Path

from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap

MEM = 8192


def _snapshot(root: Path, name: str, layers: list[tuple[str, snap.LayerKind]],
              chain: list[str]) -> Path:
    """A VM snapshot directory: ``layers`` (directory name, kind) from the base up, its own
    drive file on the ``chain`` of other snapshots' drive files (newest first)."""
    d = root / name
    d.mkdir(parents=True)
    (d / snap.DEVICE_STATE).write_bytes(b"state")
    (d / "rootfs.qcow2").write_bytes(b"drive")
    if any(n == name for n, _ in layers):
        (d / snap.MEMORY).write_bytes(b"\0" * MEM)
    m = snap.Manifest(
        driver="qemu", vm={}, memory_size=MEM,
        layers=tuple(snap.MemoryLayer(root / n, kind, 1) for n, kind in layers),
        drives=(snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2",
                                chain=tuple(root / c / "rootfs.qcow2" for c in chain)),))
    (d / snap.MANIFEST).write_text(json.dumps(m.to_json(d)))
    return d


def test_a_directory_kept_for_its_memory_does_not_keep_its_drive_chain(tmp_path: Path) -> None:
    # w: an old capture. x: memory full, its drive on w's. y (the root): memory a diff on
    # x's, its drive flattened (no chain). y reads x's memory and nothing of w.
    snaps, layers = tmp_path / "snapshots", tmp_path / "layers"
    w = _snapshot(snaps, "w", [("w", "full")], [])
    x = _snapshot(snaps, "x", [("x", "full")], ["w"])
    y = _snapshot(snaps, "y", [("x", "full"), ("y", "diff")], [])
    removed = snapshot_store.collect(snaps, layers, ["snapshot:y"])
    assert removed == [w]
    assert x.is_dir() and y.is_dir()
    assert snap.read_manifest(y).layers[0].path == x / snap.MEMORY


def test_a_roots_whole_drive_chain_and_memory_stack_are_kept(tmp_path: Path) -> None:
    snaps, layers = tmp_path / "snapshots", tmp_path / "layers"
    _snapshot(snaps, "a", [("a", "full")], [])
    _snapshot(snaps, "b", [("a", "full"), ("b", "diff")], ["a"])
    _snapshot(snaps, "c", [("c", "full")], ["b", "a"])
    unrelated = _snapshot(snaps, "u", [("u", "full")], [])
    assert snapshot_store.collect(snaps, layers, ["snapshot:c", "snapshot:b"]) == [unrelated]
    assert sorted(p.name for p in snaps.iterdir()) == ["a", "b", "c"]


def test_the_overlay_cache_forgets_overlays_of_deleted_or_replaced_bases(tmp_path: Path) -> None:
    from aenv.storage import disks

    kept, gone, replaced = (tmp_path / n for n in ("kept.raw", "gone.raw", "replaced.raw"))
    for base in (kept, gone, replaced):
        base.write_bytes(b"\0" * 65536)
    vms = tmp_path / "vms"
    for base in (kept, gone, replaced):
        disks.create_disk(base, vms / base.stem, method="qcow2")
    assert len(list((vms / disks.OVERLAY_CACHE).glob("*.qcow2"))) == 3
    gone.unlink()
    replaced.unlink()
    replaced.write_bytes(b"\1" * 65536)  # a new file: a new inode
    removed = disks.prune_overlay_cache(vms)
    assert len(removed) == 2
    assert [p.name for p in (vms / disks.OVERLAY_CACHE).glob("*.qcow2")] == \
        [disks._overlay_key(kept.resolve(), "raw") + ".qcow2"]
