"""Firecracker's snapshot format mapped onto aenv's snapshot directory (``aenv.storage.snapshots``).

A Firecracker snapshot is two files that ``PUT /snapshot/create`` writes: the microVM state
(device and vCPU state, Firecracker's own versioned format) kept as ``vmstate``, and guest
memory kept as ``memory``. Drives are not part of it: the driver copies each writable raw
drive into the directory itself. This module is the one place that knows how the two
Firecracker files relate to the VMM-neutral layout:

- **Full** (``snapshot_type: Full``): ``memory`` is every page; a *full* layer.
- **Diff merged into a clone of the parent** (incremental, dirty-page tracking on, parent is
  one full layer, and the filesystem can reflink): ``memory`` starts as a reflink of the
  parent's memory and Firecracker writes only the dirtied pages into it (it merges a Diff
  into an existing file of the right size). The result is again a *full* layer, made at a
  cost proportional to what the guest dirtied, and a restore maps it directly.
- **Diff layer** (incremental, tracking on, no reflink): ``memory`` is a sparse file holding
  only the dirtied pages at their own offsets; the pages it holds are read back from the
  file's data extents (``SEEK_DATA``/``SEEK_HOLE``) into ``memory.runs``. Used only where
  that probe is exact (page-sized blocks, real sparse-file support), and only up to
  ``MAX_DIFF_DEPTH`` layers; a restore must first merge the stack into one file.
- Anything else is a Full snapshot.

Firecracker resets its dirty bitmap on every successful ``/snapshot/create`` and on
``/snapshot/load``, so "dirtied since the parent" is exact only when the parent is the last
snapshot this VM took or was loaded from; the driver tracks that (``memory_parent``).

The machine shape (``FirecrackerMachine``: what a restore passes Firecracker again, and the
Firecracker version whose ``vmstate`` format the snapshot has) is kept in ``vm.json`` and in
every manifest's ``vm``, versioned (``aenv.runtime.machine_record``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..storage import snapshots
from ..storage.disks import reflink
from ..storage.snapshots import PAGE_SIZE, Manifest, MemoryLayer, Run
from . import machine_record
from .base import MachineRecordError
from .firecracker_api import SnapshotType

DRIVER = "firecracker"
VMSTATE = snapshots.DEVICE_STATE
MEMORY = snapshots.MEMORY
MAX_DIFF_DEPTH = 32  # diff layers kept on a base before a snapshot is Full again
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_HEAD = struct.Struct("=QQIIII")  # fm_start, fm_length, flags, mapped, count, reserved
_FIEMAP_EXTENT = struct.Struct("=QQQ2QI3I")  # logical, physical, length, reserved, flags
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_FIEMAP_BATCH = 256


@dataclass(frozen=True)
class MachineDrive:
    """A drive as Firecracker was given it (``PUT /drives``); always a raw file."""

    id: str
    read_only: bool
    root: bool


@dataclass(frozen=True)
class MachineNetwork:
    """The network interface (``PUT /network-interfaces``); a restore may name another
    tap (``network_overrides``)."""

    iface_id: str
    host_dev_name: str
    guest_mac: str


@dataclass(frozen=True)
class FirecrackerMachine:
    """The machine shape of a Firecracker VM, in ``vm.json`` and in every snapshot manifest
    (``Manifest.vm``); written by ``to_json`` and read by ``from_json`` only (a record
    without a version is version 1). ``firecracker_version``: the VMM that runs it, whose
    ``vmstate`` format a snapshot has (None until its API answered)."""

    VERSION: ClassVar[int] = 1

    vcpus: int
    memory_mib: int
    track_dirty_pages: bool
    kernel: Path
    initrd: Path | None
    boot_args: str
    drives: tuple[MachineDrive, ...]
    network: MachineNetwork | None
    firecracker_version: str | None = None

    @property
    def memory_size(self) -> int:
        return self.memory_mib << 20

    def with_tap(self, tap: str) -> FirecrackerMachine:
        """The same machine on another host tap (a restore into a new slot)."""
        if self.network is None:
            return self
        return dataclasses.replace(
            self, network=dataclasses.replace(self.network, host_dev_name=tap))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": self.VERSION,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "track_dirty_pages": self.track_dirty_pages,
            "kernel": str(self.kernel),
            "initrd": str(self.initrd) if self.initrd else None,
            "boot_args": self.boot_args,
            "drives": [{"id": d.id, "read_only": d.read_only, "root": d.root}
                       for d in self.drives],
            "network": dataclasses.asdict(self.network) if self.network else None,
        }
        if self.firecracker_version is not None:
            data["firecracker_version"] = self.firecracker_version
        return data

    @classmethod
    def from_json(cls, data: object, where: object) -> FirecrackerMachine:
        """The record in ``data``; ``MachineRecordError`` (naming ``where``) for another
        version or a malformed one."""
        m = machine_record.fields(data, version=cls.VERSION,
                                  kind="firecracker machine record", where=where)
        try:
            net = m["network"]
            return cls(
                vcpus=int(m["vcpus"]), memory_mib=int(m["memory_mib"]),
                track_dirty_pages=bool(m["track_dirty_pages"]), kernel=Path(m["kernel"]),
                initrd=Path(m["initrd"]) if m["initrd"] else None,
                boot_args=str(m["boot_args"]),
                drives=tuple(MachineDrive(str(d["id"]), bool(d["read_only"]), bool(d["root"]))
                             for d in m["drives"]),
                network=MachineNetwork(str(net["iface_id"]), str(net["host_dev_name"]),
                                       str(net["guest_mac"])) if net else None,
                firecracker_version=m.get("firecracker_version"))
        except (KeyError, TypeError, ValueError) as e:
            raise MachineRecordError(
                f"{where}: malformed firecracker machine record ({e!r})") from e


@dataclass(frozen=True)
class Plan:
    """How one snapshot is taken: what to ask Firecracker for and which layers it extends."""

    snapshot_type: SnapshotType
    kind: snapshots.LayerKind  # kind of the layer the new ``memory`` file becomes
    base: tuple[MemoryLayer, ...] = ()  # parent layers the new layer sits on (diff only)
    parent: Path | None = None  # snapshot directory the diff is relative to
    compacted: bool = False  # a diff was possible, but the stack was too deep: Full

    @property
    def method(self) -> str:
        if self.snapshot_type == "Full":
            return "full"
        return "diff-merged" if self.kind == "full" else "diff-layer"


def plan(staging: Path, parent: Manifest | None, parent_dir: Path | None, *,
         incremental: bool, track_dirty_pages: bool) -> Plan:
    """Choose the snapshot type; for a merged diff this already clones the parent's memory
    into ``staging``."""
    if not (incremental and track_dirty_pages and parent is not None and parent_dir):
        return Plan("Full", "full")
    if parent.diff_depth == 0:
        try:
            reflink(parent.layers[0].path, staging / MEMORY)
            return Plan("Diff", "full", parent=parent_dir)
        except OSError:
            pass  # no shared extents here: fall through to a diff layer
    if not sparse_extents_exact(staging):
        return Plan("Full", "full")
    if parent.diff_depth >= MAX_DIFF_DEPTH:
        return Plan("Full", "full", compacted=True)
    return Plan("Diff", "diff", base=parent.layers, parent=parent_dir)


def finish_memory(p: Plan, staging: Path, directory: Path) -> tuple[MemoryLayer, ...]:
    """The memory layers of the new snapshot once Firecracker has written ``memory``
    (``directory`` is where the snapshot will live after ``commit``)."""
    mem = staging / MEMORY
    if p.kind == "full":
        return (MemoryLayer(directory, "full", snapshots.allocated(mem) // PAGE_SIZE),)
    runs = data_runs(mem)
    snapshots.write_runs(staging / snapshots.MEMORY_RUNS, runs)
    return (*p.base, MemoryLayer(directory, "diff", sum(n for _, n in runs)))


def written_bytes(p: Plan, staging: Path, layers: tuple[MemoryLayer, ...]) -> int:
    """Bytes of guest memory this snapshot wrote itself: all of it for a Full, the dirtied
    pages for a Diff (for a merged one: the extents no longer shared with the parent)."""
    mem = staging / MEMORY
    if p.method == "diff-layer":
        return layers[-1].pages * PAGE_SIZE
    if p.method == "diff-merged":
        unshared = unshared_bytes(mem)
        if unshared is not None:
            return unshared
    return snapshots.allocated(mem)


def unshared_bytes(path: Path) -> int | None:
    """Bytes of ``path``'s extents that share no blocks with another file (FIEMAP), or None
    where the filesystem cannot say."""
    total = 0
    start = 0
    with open(path, "rb") as f:
        while True:
            buf = bytearray(_FIEMAP_HEAD.size + _FIEMAP_BATCH * _FIEMAP_EXTENT.size)
            _FIEMAP_HEAD.pack_into(buf, 0, start, 2**64 - 1 - start, 0, 0, _FIEMAP_BATCH, 0)
            try:
                fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf)
            except OSError:
                return None
            mapped = _FIEMAP_HEAD.unpack_from(buf, 0)[3]
            if mapped == 0:
                return total
            for i in range(mapped):
                ext = _FIEMAP_EXTENT.unpack_from(buf, _FIEMAP_HEAD.size + i * _FIEMAP_EXTENT.size)
                logical, length, flags = ext[0], ext[2], ext[5]
                if not flags & _FIEMAP_EXTENT_SHARED:
                    total += length
                if flags & _FIEMAP_EXTENT_LAST:
                    return total
                start = logical + length


def memory_for_restore(manifest: Manifest, workdir: Path) -> Path:
    """The file to load guest memory from. A single full layer is used in place (every VM
    restored from it shares its page cache); a stack is merged into ``workdir/memory``
    first: a clone of the base (reflink, else a sparse copy) with each page of the diff
    layers written once, from the newest layer that holds it."""
    if manifest.diff_depth == 0:
        return manifest.layers[0].path
    dest = workdir / MEMORY
    dest.unlink(missing_ok=True)
    clone(manifest.layers[0].path, dest)
    owners = snapshots.owner_map(manifest.layers, manifest.npages)
    with open(dest, "r+b") as out:
        for index, layer in enumerate(manifest.layers[1:], 1):
            with open(layer.path, "rb") as src:
                for first, count in snapshots.runs_where(owners, index):
                    _copy_range(src.fileno(), out.fileno(), first * PAGE_SIZE,
                                count * PAGE_SIZE)
    return dest


def clone(src: Path, dest: Path) -> tuple[str, int]:
    """Copy a file the cheapest way this filesystem allows: which way, and bytes copied."""
    try:
        reflink(src, dest)
        return "reflink", 0
    except OSError:
        return "copy", snapshots.copy_sparse(src, dest)


def data_runs(path: Path) -> list[Run]:
    """Page runs ``(first, count)`` of the data extents of a sparse file."""
    runs: list[Run] = []
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            first, last = start // PAGE_SIZE, -(-end // PAGE_SIZE)
            if runs and runs[-1][0] + runs[-1][1] == first:
                runs[-1] = (runs[-1][0], last - runs[-1][0])
            else:
                runs.append((first, last - first))
            offset = end
    return runs


def sparse_extents_exact(directory: Path) -> bool:
    """Whether files in ``directory`` report data extents page by page (cached per
    filesystem). Where they do not (blocks larger than a page, or no SEEK_DATA support, in
    which case the whole file reads as data), a diff layer's runs would claim pages it does
    not hold, so such filesystems only get full snapshots."""
    dev = os.stat(directory).st_dev
    if dev not in _extents_exact:
        _extents_exact[dev] = _probe_extents(directory)
    return _extents_exact[dev]


_extents_exact: dict[int, bool] = {}


def _probe_extents(directory: Path) -> bool:
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".aenv-extents-") as f:
        os.ftruncate(f.fileno(), 3 * PAGE_SIZE)
        os.pwrite(f.fileno(), b"\1" * PAGE_SIZE, PAGE_SIZE)
        os.fsync(f.fileno())
        if os.fstat(f.fileno()).st_blksize > PAGE_SIZE:
            return False
        return data_runs(Path(f.name)) == [(1, 1)]


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` from ``src`` to the same offset of ``dst``, in
    the kernel."""
    done = 0
    while done < length:
        n = os.copy_file_range(src, dst, length - done, offset + done, offset + done)
        if n == 0:
            raise snapshots.SnapshotFilesError("memory layer is shorter than its runs say")
        done += n
