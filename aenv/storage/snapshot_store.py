"""The node's local snapshot store: where snapshots live, how the store names them, what
depends on what, and garbage collection by reachability.

A reference ``snapshot:<id>`` (``image_ref``) names ``snapshots_dir/<id>``: either a VM
snapshot written by a runtime driver (``aenv.storage.snapshots`` layout, complete once its
manifest exists) or a *disk-only* snapshot of a filesystem pause (``disk.json`` + the drive
file; resuming it boots). ``layer:<id>`` names a committed template layer
(``disk_layers``). Snapshots and layers reference their parents by absolute path (memory
layers, qcow2 backing chains), so one is deleted only when no root reaches it; roots are
what the store of record still uses (templates, paused sandboxes, what running sandboxes
were restored from). A root keeps what its own manifest names and no more (``reachable``).
Directories being written are ``.<id>.partial-*``; a crash leaves them behind and collection
removes them — the caller serialises collection with snapshot writes.
Collection fails closed: when what a root (or a layer) depends on cannot be read,
nothing is deleted in that pass.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import disk_layers, durable, snapshots
from .disks import Disk
from .errors import StorageError
from .image_ref import SNAPSHOT_PREFIX, BadImageRef, ImageRef

log = logging.getLogger("aenv.snapshots")

SNAPSHOT = SNAPSHOT_PREFIX  # the prefix of snapshot references, for older importers
DISK_MANIFEST = "disk.json"


class SnapshotMissing(StorageError):
    """A reference names no complete snapshot."""


class DependenciesUnknown(StorageError):
    """What a snapshot or layer reads from cannot be determined (its manifest or qcow2
    header is unreadable): collection must not delete anything it might depend on."""


@dataclass(frozen=True)
class DiskSnapshot:
    """A filesystem-only pause: the root disk, to be booted again."""

    directory: Path
    drive: Path
    format: str


def ref(snapshot_id: str) -> str:
    return str(ImageRef.snapshot(snapshot_id))


def directory(root: Path, reference: str | ImageRef) -> Path:
    """The directory of the snapshot ``reference`` names; ``SnapshotMissing`` when it names
    no snapshot."""
    try:
        parsed = reference if isinstance(reference, ImageRef) else ImageRef.parse(reference)
    except BadImageRef as e:
        raise SnapshotMissing(str(e)) from None
    if not parsed.is_snapshot:
        raise SnapshotMissing(f"not a snapshot reference: {str(reference)!r}")
    return root / parsed.id


def is_complete(path: Path) -> bool:
    return (path / snapshots.MANIFEST).is_file() or (path / DISK_MANIFEST).is_file()


def disk_snapshot(path: Path) -> DiskSnapshot | None:
    """The disk-only snapshot at ``path``, or None when it is a VM snapshot."""
    try:
        meta = json.loads((path / DISK_MANIFEST).read_text())
    except FileNotFoundError:
        return None
    return DiskSnapshot(path, path / meta["drive"], meta["format"])


def save_disk(disk: Disk, path: Path) -> DiskSnapshot:
    """Keep the disk of a VM whose vCPUs are stopped (its image flushed) as a new disk-only
    snapshot at ``path``, durable on return. The file is linked in, not moved: the VM's own
    name stays until the caller removes it after the VM ended, so a failure at any step
    (ENOSPC writing the manifest, say) removes only the partial snapshot and leaves the
    VM and its disk as they were."""
    staging = snapshots.begin(path)
    name = f"rootfs.{disk.format}"
    try:
        try:
            os.link(disk.path, staging / name)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            snapshots.copy_sparse(disk.path, staging / name)  # snapshots on another fs
        durable.write_atomic(staging / DISK_MANIFEST,
                             json.dumps({"drive": name, "format": disk.format}).encode())
        durable.fsync_tree(staging)
        durable.rename_durably(staging, path)
    except BaseException:
        snapshots.abort(staging)
        raise
    return DiskSnapshot(path, path / name, disk.format)


def backing_chain(image: Path) -> list[Path]:
    """Files an image reads through (qcow2 backing files), nearest first. A missing image
    reads nothing; one that exists but cannot be read raises ``DependenciesUnknown``."""
    if image.suffix != ".qcow2" or not image.exists():
        return []
    out = subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", "-U",
                          str(image)], capture_output=True, text=True, check=False)
    try:
        if out.returncode != 0:
            raise ValueError(out.stderr.strip() or f"qemu-img exited {out.returncode}")
        return [Path(i["filename"]) for i in json.loads(out.stdout)[1:]]
    except (ValueError, KeyError, TypeError) as e:
        raise DependenciesUnknown(f"cannot read the backing chain of {image}: {e}") from e


def dependencies(path: Path, snapshots_root: Path, layers_root: Path) -> set[Path]:
    """Snapshot directories and layer files that the snapshot directory or layer file at
    ``path`` reads from."""
    files: set[Path] = set()
    if path.is_dir():
        try:
            disk = disk_snapshot(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DependenciesUnknown(f"{path}: unreadable {DISK_MANIFEST}: {e}") from e
        if disk is None:
            try:
                m = snapshots.read_manifest(path)
            except StorageError as e:
                raise DependenciesUnknown(f"{path}: {e}") from e
            # Retired layers: a reader of the manifest before a merge may still open them.
            files = {la.path for la in m.layers} | set(m.retired)
            for d in m.drives:
                files.update(d.chain)
                if d.root is not None:
                    files.add(d.root)
        else:
            files = set(backing_chain(disk.drive))
    else:
        files = set(backing_chain(path))
    out: set[Path] = set()
    for f in files:
        if f.parent == snapshots_root or f.parent.parent == snapshots_root:
            owner = f if f.parent == snapshots_root else f.parent
            if owner != path:
                out.add(owner)
        elif f.parent == layers_root:
            out.add(f)
    return out


def reachable(snapshots_root: Path, layers_root: Path, roots: Iterable[str]) -> set[Path]:
    """The snapshot directories and layer files ``roots`` need. A snapshot's manifest names
    its whole closure (every memory layer of its stack, every file of each drive's backing
    chain, the image the chain ends on), and so does a qcow2 backing chain, so a directory
    that a root reads from is kept without following *its* manifest: that would keep what
    only the directory's own (unused) restore reads — the drive chain behind a memory
    layer, the memory stack behind a drive — and so on back through every capture of a
    sandbox's life. Layer files are followed (cheap, and a layer may sit on another)."""
    keep: set[Path] = set()
    todo: list[tuple[Path, bool]] = []  # (path, follow its dependencies)
    for r in roots:
        try:
            root = ImageRef.parse(r)
            if root.is_snapshot:
                todo.append((directory(snapshots_root, root), True))
            elif root.is_layer:
                todo.append((disk_layers.resolve(root, layers_root).path, True))
        except StorageError:  # BadImageRef, SnapshotMissing, DiskLayerError: nothing to keep
            continue
    expanded: set[Path] = set()
    while todo:
        p, follow = todo.pop()
        keep.add(p)
        if not follow or p in expanded:
            continue
        expanded.add(p)
        for dep in dependencies(p, snapshots_root, layers_root):
            todo.append((dep, dep.parent == layers_root))
    return keep


def collect(snapshots_root: Path, layers_root: Path, roots: Iterable[str]) -> list[Path]:
    """Delete every snapshot and layer no root reaches; returns what was deleted. Raises
    ``DependenciesUnknown`` (having deleted nothing) when a reachable snapshot's or layer's
    own dependencies cannot be read."""
    keep = reachable(snapshots_root, layers_root, roots)
    removed = []
    if snapshots_root.is_dir():
        for entry in snapshots_root.iterdir():
            if entry not in keep:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    if layers_root.is_dir():
        for entry in layers_root.iterdir():
            layer = entry.with_suffix(".qcow2") if entry.suffix == ".json" else entry
            raw = entry.with_suffix(".raw") if entry.suffix == ".json" else entry
            if layer in keep or raw in keep:
                continue
            entry.unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        log.info("removed %d unused snapshots/layers", len(removed))
    return removed
