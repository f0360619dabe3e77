"""The QEMU driver's snapshots: what ``QemuVM.snapshot`` writes and ``QemuRuntime.restore``
reads, in the directory layout of ``aenv.storage.snapshots``. The format lives here only:
the capture's steps (``QemuCapture``, run by the shared recipe of
``aenv.runtime.snapshot_recipe``), the machine record (``QemuMachine``) and the restore's
plan.

Device state: ``xen-save-devices-state`` (QEMU 7.2 has no ``mapped-ram`` and no ``file:``
migration). It writes every device's state and *no RAM*, whatever the RAM backend, in ~2 ms
and ~20 KiB. Unlike ``x-ignore-shared``, which skips only ``share=on`` RAM, it keeps the save
O(1) for restored VMs too, whose RAM is a private (``share=off``) mapping. The restore side
loads it as an ordinary incoming migration (``-incoming defer``, then ``migrate-incoming
fd:N``; ``-S``; ``send-configuration=off`` since the save has no configuration section).
QEMU writes no ROM images into RAM while a migration is pending, so the restored RAM is
exactly the mapped base plus the diff pages, which are written *before* the state loads:
virtio's load checks its ring indices in guest RAM and marks a device broken on mismatch.

Memory, two cases:
- A *booted* VM maps its own RAM file ``share=on`` (tmpfs, ``workdir.MEMORY``). Its snapshot
  is a full layer: a sparse copy of that file (in-kernel ``sendfile`` of the allocated
  extents), made while frozen, or after the VMM quit when pausing. This costs the RAM the
  guest has touched; it happens once per template build.
- A *restored* VM maps the snapshot's base image ``share=off`` and got the diff layers
  written over it before its vCPUs started. Its snapshot scans ``/proc/<pid>/pagemap``
  (``guest_memory``) for the pages it holds privately — the written ones — compares each
  with the copy the layer stack has, and writes only the pages that differ as a new diff
  layer. Pause, snapshot and fork cost O(written pages) plus a scan of 8 bytes per page.
  Restore costs O(device state + diff pages), not O(RAM): the base is mapped, never read.
  Every restore of one snapshot shares the base's page cache; each holds only its diff
  pages and what it writes itself as private memory.
- Chains: a diff layer is added per snapshot; a stack deeper than ``max_chain`` diffs is
  merged into one diff *after* the capture, in the background (``prepare_compaction``,
  ``aenv.storage.memory_compaction``). Only when the stack has grown to twice that (the
  background fell behind: ``memory_compaction.compacts_inline``) does the capture itself
  compact: the new layer then holds every page that differs from the base (one diff on
  the base); if that is more than half of RAM, a new full image is written (O(RAM), rare).
  ``incremental=False`` always writes the full image.

Deferred memory (``capture_deferred``, ``QemuVM.pause_deferred``; issue 21: the guest is
frozen, and the request waits, only for what must be consistent): a restored VM's pause runs
the recipe without copying its written pages; the snapshot is committed with its device
state, its drives and a ``memory.pending`` marker (``snapshots.PendingMemory``) and a
manifest naming only the parent's layers, and the VMM stays alive and frozen. The pages are
then copied out of it (``QemuDeferredMemory.write``, as ``save_memory`` would have), made
durable, the manifest rewritten to name the new layer, the marker removed, and only then
the VMM ended. Nothing restores a marked snapshot (``prepare_restore`` refuses it); the
marker names the VMM's working directory so that a server that stopped in between can
adopt the still-frozen VMM and write the layer again from the start. The copy costs what
it did, only after the answer (``benchmarks/snapshot_writes.py``, ``pause_after_dirtying``,
compares both ways; with 200 MiB written under TCG on a loaded 2-core host the pause
answered in ~16 ms instead of ~640 ms, and the write took ~590 ms after it). A booted VM's
pause (its own RAM file) is never deferred.

A resume during that write takes the VMM back instead (``QemuDeferredMemory.abandon``, for
``NodeMachines``' resume in place): the write checks a gate before each 8 MiB chunk and
closes it just before the manifest is rewritten (or before a failed write ends the VMM);
whichever side comes first has the VMM. Abandoning waits for the copy's thread, renames the
marker ``memory.abandoned`` (fsynced: the one step after which a restart treats the VMM as
the running sandbox's, not a pause's), removes an interrupted copy's files and gives the
drive tops back to the VM's uid. The pause had hard-linked each top into the snapshot
(``_take_drive``), so the continued VM writes into a file the snapshot also names: that is
why the snapshot is abandoned, never restored, and only its name goes at collection. The
VM's lineage never changed (a pause does not save it), so the continued VM's next snapshot
diffs against the same parent as before the pause.

Drives (qcow2): pausing moves the VM's top overlay into the snapshot (O(1)); a running
snapshot hard-links the frozen top into the snapshot and switches the VM onto a new overlay
(``blockdev-snapshot-sync`` onto a file created before the freeze), so the freeze holds no
disk copy; a capture that fails after the switch commits the new overlay back into the
old top (``block-commit``, the switch's undo), so the VM writes what its lineage names.
A restore gets a new overlay over the snapshot's file. When a snapshot's qcow2 chain is
deeper than ``max_chain`` snapshot layers, its file is flattened onto the chain's root image
(copy of the file + qemu-img safe rebase: O(data written in the chain)) *after* the capture
returned, in the background (``prepare_compaction``, run by ``aenv.runtime.compaction``):
the flattened copy is made and fsynced beside the file, renamed over it (``install``), and
only a while later does the manifest stop naming the old chain (``release``), so that at
every moment the directory restores and nothing it reads can be collected. A capture reads
its parent's chain from the qcow2 headers, so a compaction installed but not yet released
already shortens the next snapshot's chain. ``incremental=False`` still flattens within the
capture (it promises a self-contained snapshot on return). Writable raw drives (reflink
hosts) are moved on pause and reflinked while frozen otherwise. Read-only drives are
referenced, not copied.

Write tracking (``write_tracking``): a restored VM keeps every page it wrote since its
restore private, so without help each later snapshot re-reads and compares all of them, and
its freeze grows with everything written since the restore. QEMU started with the tracking
library records its writes (userfaultfd write protection, asynchronous), and a capture whose
record starts at its parent compares only the pages written since then; the record restarts
at every capture and at the restore. A capture that compacts, or finds no valid record
(after a failed capture or an abandoned deferred write, or without the library), compares
every written page as before.

Why not the alternatives QEMU 7.2 offers: a streaming migration (and ``background-snapshot``,
which only shortens the freeze) writes all of RAM; ``x-ignore-shared`` skips only
``share=on`` RAM, which a restore cannot use without writing into the snapshot; the
migration's dirty log exists only during a migration that sends the pages anyway, and
``calc-dirty-rate`` estimates a rate, not a page set (hence ``write_tracking``). Giving
each VM its own reflinked RAM file mapped ``share=on`` would make pause O(1) with no diff
at all, but needs XFS or btrfs
(this host's data dir is ext4, /dev/shm is tmpfs: neither reflinks).

The VM's working directory records which snapshot it derives from and its active drive
files in ``lineage.json``, so a snapshot after a server restart (``attach``) is still
incremental.

Confinement (``aenv.runtime.confine``): QEMU runs as its own uid in a chroot of its working
directory, so it opens nothing by a host path after its start-up. The device state is
written to a file descriptor the driver opens and passes (``add-fd``, then
``/dev/fdset/N``); the overlay a running snapshot switches to is created in the working
directory and given to the VM's uid before ``blockdev-snapshot-sync`` opens it by its
fixed name. Every file that leaves the VM for a snapshot is given back to root.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import json
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..phase_timer import PhaseTimer
from ..storage import durable, memory_compaction
from ..storage import snapshots as snap
from ..storage.disks import DiskError, create_disk, reflink
from ..storage.errors import StorageError
from . import guest_memory as gm
from . import machine_record, snapshot_recipe, write_tracking
from . import workdir as wd
from .base import (
    Accel,
    Compaction,
    DeferredMemory,
    Drive,
    DriveFormat,
    MachineRecordError,
    MemoryWriteAbandoned,
    NotSupportedError,
    RestoreOverrides,
    SnapshotError,
    SnapshotInfo,
    VMError,
    VMSpec,
)
from .confine import Jail
from .snapshot_recipe import Capture, Captured, CaptureSteps

if TYPE_CHECKING:
    from .qemu import QemuVM

log = logging.getLogger("aenv.runtime")

DRIVER = "qemu"
DEFAULT_MAX_CHAIN = 4  # diff layers on a memory base, snapshot layers in a qcow2 chain
FULL_FRACTION = 0.5  # compaction writes a full image when more than this much RAM differs
PAGE = snap.PAGE_SIZE
_CHUNK_PAGES = 2048  # 8 MiB per read of guest memory
# Byte offsets within a page that are compared for every page of a run at once (strided
# slices, one C loop each): a page that changed almost always differs at one of them.
_SAMPLES = (0, 1024 + 8, 2048 + 16, 3072 + 24, PAGE - 8)
_KEPT_BUFFERS = 2  # buffer pairs kept for later captures (16 MiB each)
_SAME_OWNER = re.compile(rb"(.)\1*", re.S)
_NONZERO = bytes([0] + [1] * 255)
_DIFFERENT = re.compile(rb"\x01+")
_AGREEING = re.compile(rb"\x00+")


# -- what the working directory records -------------------------------------------------------


@dataclass(frozen=True)
class MachineDrive:
    """A drive as the machine record keeps it: which device, in which format."""

    id: str
    format: DriveFormat
    read_only: bool

    @property
    def name(self) -> str:
        """Its fixed name in a working directory (``workdir.drive_name``)."""
        return f"{self.id}.{self.format}"


@dataclass(frozen=True)
class QemuMachine:
    """The machine shape a restore must rebuild exactly: kept in ``vm.json`` and in every
    snapshot manifest (``Manifest.vm``), written by ``to_json`` and read by ``from_json``
    only (``aenv.runtime.machine_record``: a record without a version is version 1).
    Host paths are of shared, immutable files (kernel, initrd). ``memory_file``: guest RAM
    is a file the VMM maps (snapshots need it)."""

    VERSION: ClassVar[int] = 1

    vcpus: int
    memory_mib: int
    accel: Accel
    kernel: Path
    initrd: Path | None
    boot_args: str
    mac: str
    tap: str | None
    memory_file: bool
    drives: tuple[MachineDrive, ...]

    @classmethod
    def of(cls, spec: VMSpec, accel: Accel) -> QemuMachine:
        return cls(
            vcpus=spec.vcpus, memory_mib=spec.memory_mib, accel=accel,
            kernel=spec.kernel.resolve(),
            initrd=spec.initrd.resolve() if spec.initrd else None, boot_args=spec.boot_args,
            mac=spec.mac, tap=spec.tap, memory_file=spec.memory_file is not None,
            drives=tuple(MachineDrive(d.id, d.format, d.read_only) for d in spec.drives))

    @property
    def memory_size(self) -> int:
        return self.memory_mib << 20

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
            "accel": self.accel,
            "kernel": str(self.kernel),
            "initrd": str(self.initrd) if self.initrd else None,
            "boot_args": self.boot_args,
            "mac": self.mac,
            "tap": self.tap,
            "memory_file": self.memory_file,
            "drives": [{"id": d.id, "format": d.format, "read_only": d.read_only}
                       for d in self.drives],
        }

    @classmethod
    def from_json(cls, data: object, where: object) -> QemuMachine:
        """The record in ``data``; ``MachineRecordError`` (naming ``where``) for another
        version or a malformed one."""
        m = machine_record.fields(data, version=cls.VERSION, kind="qemu machine record",
                                  where=where)
        try:
            return cls(
                vcpus=int(m["vcpus"]), memory_mib=int(m["memory_mib"]), accel=m["accel"],
                kernel=Path(m["kernel"]), initrd=Path(m["initrd"]) if m["initrd"] else None,
                boot_args=str(m["boot_args"]), mac=str(m["mac"]), tap=m["tap"],
                memory_file=bool(m["memory_file"]),
                drives=tuple(MachineDrive(str(d["id"]), d["format"], bool(d["read_only"]))
                             for d in m["drives"]))
        except (KeyError, TypeError, ValueError) as e:
            raise MachineRecordError(f"{where}: malformed qemu machine record ({e!r})") from e


def read_machine(workdir: Path) -> QemuMachine:
    """The machine record of a VM's working directory (its ``vm.json``)."""
    path = workdir / wd.MANIFEST
    try:
        data = json.loads(path.read_text())["machine"]
    except (OSError, ValueError, KeyError) as e:
        raise SnapshotError(f"{workdir} has no machine record: {e}") from e
    return QemuMachine.from_json(data, path)


@dataclass
class Lineage:
    """Where a VM's state comes from. ``memory``: ``shared`` = its own RAM file (booted),
    ``private`` = a snapshot's base mapped copy-on-write (restored). ``parent``: the snapshot
    whose layers it derives from. ``tops``: the active file (name in the working directory)
    of each writable drive; ``generation`` numbers the overlays made by running snapshots."""

    memory: Literal["shared", "private"]
    parent: Path | None
    tops: dict[str, str]
    generation: int = 0

    @classmethod
    def load(cls, workdir: Path, machine: QemuMachine) -> Lineage:
        try:
            data = json.loads((workdir / wd.LINEAGE).read_text())
        except FileNotFoundError:
            tops = {d.id: d.name for d in machine.drives if not d.read_only}
            return cls("shared", None, tops)
        return cls(data["memory"], Path(data["parent"]) if data["parent"] else None,
                   data["tops"], data.get("generation", 0))

    def save(self, workdir: Path) -> None:
        tmp = workdir / (wd.LINEAGE + ".tmp")
        tmp.write_text(json.dumps({"memory": self.memory,
                                   "parent": str(self.parent) if self.parent else None,
                                   "tops": self.tops, "generation": self.generation}))
        os.replace(tmp, workdir / wd.LINEAGE)


# -- capture ----------------------------------------------------------------------------------


@dataclass
class _DrivePlan:
    id: str
    format: Literal["raw", "qcow2"]
    read_only: bool
    top: Path | None = None  # real path of the VM's active file
    file: str | None = None  # its name in the snapshot
    chain: tuple[Path, ...] = ()
    root: Path | None = None
    root_format: str | None = None
    flatten: bool = False
    new_top: str | None = None  # running qcow2 capture: overlay the VM continues on

    def image(self) -> snap.DriveImage:
        if self.read_only:
            return snap.DriveImage(self.id, self.format, True, path=self.top)
        return snap.DriveImage(self.id, self.format, False, file=self.file, chain=self.chain,
                               root=self.root, root_format=self.root_format)


def _plan_drives(workdir: Path, machine: QemuMachine, lineage: Lineage,
                 parent: snap.Manifest | None, directory: Path, *, stop: bool,
                 incremental: bool, max_chain: int, jail: Jail) -> list[_DrivePlan]:
    """Decide what happens to each drive, and make the overlays a running VM will switch
    to, before the freeze (qemu-img takes ~20 ms a call)."""
    plans = []
    for d in machine.drives:
        p = _DrivePlan(d.id, d.format, d.read_only)
        if p.read_only:
            p.top = (workdir / f"{p.id}.{p.format}").resolve()
            plans.append(p)
            continue
        p.top = (workdir / lineage.tops[p.id]).resolve()
        p.file = f"{p.id}.{p.format}"
        inherited = parent.drive(p.id) if parent is not None else None
        if p.format == "raw":
            plans.append(p)  # a reflink copy or the moved file: self-contained
            continue
        info = snap.image_info(p.top)
        if inherited is not None and inherited.file is not None:
            assert lineage.parent is not None
            parent_file = lineage.parent / inherited.file
            p.chain = (parent_file, *_chain_between(parent_file, inherited.root,
                                                    inherited.chain))
            p.root, p.root_format = inherited.root, inherited.root_format
        else:
            p.root, p.root_format = info.backing, info.backing_format
        # Deeper than max_chain: compacted after the capture (prepare_compaction).
        p.flatten = not incremental
        if not stop:
            p.new_top = f"{p.id}.{lineage.generation + 1}.qcow2"
            new = workdir / p.new_top
            new.unlink(missing_ok=True)
            snap.create_overlay(new, directory / p.file, "qcow2", info.virtual_size)
            jail.give(new)  # QEMU opens it after it dropped root
        plans.append(p)
    return plans


def _chain_between(image: Path, root: Path | None,
                   recorded: tuple[Path, ...]) -> tuple[Path, ...]:
    """The files ``image`` reads through above ``root``, nearest first, as the qcow2 headers
    say (a compaction installed but not yet released left the manifest's ``recorded`` chain
    longer than the truth); ``recorded`` when the headers do not lead to ``root``."""
    out: list[Path] = []
    current = image
    for _ in range(len(recorded) + 1):
        info = snap.qcow2_info(current)
        if info is None:
            return recorded
        if info.backing == root:
            return tuple(out)
        if info.backing is None:
            return recorded
        out.append(info.backing)
        current = info.backing
    return recorded


@dataclass
class _MemoryResult:
    layers: tuple[snap.MemoryLayer, ...]
    written: int  # bytes this snapshot wrote
    compacted: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    # copy: of a booted VM's RAM file; full, diff: a restored VM's new layer; none: unchanged
    method: str = "copy"
    # The VMM's write record (``write_tracking``) was started again by this capture: once
    # the snapshot is committed, the record is "since this snapshot".
    armed: bool = False


def _capture_shared(workdir: Path, staging: Path) -> _MemoryResult:
    """A booted VM's own RAM file, copied sparse into a full layer."""
    copied = snap.copy_sparse((workdir / wd.MEMORY).resolve(), staging / snap.MEMORY)
    layer = snap.MemoryLayer(staging, "full", snap.allocated(staging / snap.MEMORY) // PAGE)
    return _MemoryResult((layer,), copied)


def _pread(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:  # layer files are full size: only a truncated file gets here
        raise snap.SnapshotFilesError(f"short read of a memory layer at {offset:#x}")
    return data


def _write_changed(mem: gm.ProcessMemory, writer: snap.LayerWriter,
                   runs: list[tuple[int, int]], owners: bytes | bytearray | None,
                   ref_fds: list[int], check: Callable[[], None] | None = None) -> None:
    """Write the pages of ``runs`` whose guest content differs from the stack's copy (the
    layer named by ``owners``; ``owners`` None: write them all). ``check`` is called
    before each chunk (a deferred write's: it raises once the write was abandoned).

    Guest pages and their stack copies are read into two buffers kept from one capture to
    the next (``_take_buffers``), not into new objects per chunk, and changed runs are
    written from slices of them without a copy. Which pages differ is found without a
    Python loop per page (``_differing_pages``): a run of 200 MiB of new content used to
    cost ~500 ms of page-by-page comparisons on this host, now a few milliseconds."""
    data, ref = _take_buffers()
    view, ref_view = memoryview(data), memoryview(ref)
    try:
        for start, count in gm.split_runs(runs, _CHUNK_PAGES):
            if check is not None:
                check()
            mem.read_into(start, view[:count * PAGE])
            if owners is None:
                writer.write(start, view[:count * PAGE])
                continue
            for m in _SAME_OWNER.finditer(owners, start, start + count):
                first, n = m.start(), m.end() - m.start()
                off = (first - start) * PAGE
                _pread_into(ref_fds[owners[first]], ref_view[:n * PAGE], first * PAGE)
                flags = _differing_pages(data, off, ref, n)
                for d in _DIFFERENT.finditer(flags):
                    writer.write(first + d.start(),
                                 view[off + d.start() * PAGE:off + d.end() * PAGE])
    finally:
        view.release()
        ref_view.release()
        _give_buffers(data, ref)


def _differing_pages(data: mmap.mmap, off: int, ref: mmap.mmap, n: int) -> bytearray:
    """One byte per page of the ``n`` pages at ``data[off:]`` against those at ``ref[0:]``:
    1 where they differ. Every page is first compared at the ``_SAMPLES`` offsets, all pages
    at once (a strided slice of each buffer per offset, XOR-ed as two integers); pages that
    agree at every sample are then compared in full, a run of them with one comparison,
    halved where it differs. New content thus costs a few C loops per chunk, unchanged
    content one ``memcmp`` per run."""
    end = off + n * PAGE
    x = 0
    for k in _SAMPLES:
        x |= (int.from_bytes(data[off + k:end:PAGE], "little")
              ^ int.from_bytes(ref[k:n * PAGE:PAGE], "little"))
    flags = bytearray(x.to_bytes(n, "little").translate(_NONZERO))
    pending = [(m.start(), m.end()) for m in _AGREEING.finditer(flags)]
    while pending:
        lo, hi = pending.pop()
        if data[off + lo * PAGE:off + hi * PAGE] == ref[lo * PAGE:hi * PAGE]:
            continue
        if hi - lo == 1:
            flags[lo] = 1
            continue
        mid = (lo + hi) // 2
        pending += ((lo, mid), (mid, hi))
    return flags


_buffers: list[tuple[mmap.mmap, mmap.mmap]] = []  # kept between captures: faulted in once
_buffers_lock = threading.Lock()


def _take_buffers() -> tuple[mmap.mmap, mmap.mmap]:
    """A pair of ``_CHUNK_PAGES`` buffers for one capture: one kept from an earlier capture
    (its pages are already there: fresh memory is what costs most on a host that is itself
    a VM, ~40 ms for two new 8 MiB buffers under load), else new ones."""
    size = _CHUNK_PAGES * PAGE
    with _buffers_lock:
        while _buffers:
            pair = _buffers.pop()
            if len(pair[0]) == size:
                return pair
    return mmap.mmap(-1, size), mmap.mmap(-1, size)


def _give_buffers(data: mmap.mmap, ref: mmap.mmap) -> None:
    with _buffers_lock:
        if len(_buffers) < _KEPT_BUFFERS:
            _buffers.append((data, ref))
            return
    data.close()
    ref.close()


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n <= 0:  # layer files are full size: only a truncated file gets here
            raise snap.SnapshotFilesError(f"short read of a memory layer at {offset + pos:#x}")
        pos += n


def _capture_private(pid: int, workdir: Path, staging: Path, parent: snap.Manifest,
                     parent_dir: Path, *, incremental: bool, max_chain: int,
                     check: Callable[[], None] | None = None) -> _MemoryResult:
    """A restored VM: the pages it wrote, against its parent's layer stack (``check``:
    ``_write_changed``'s). Only the pages written since the parent (``parent_dir``) was
    taken, when ``write_tracking`` recorded them from then on; else every page written
    since the restore. Either way the record starts again here (``_MemoryResult.armed``)."""
    t = PhaseTimer()
    size = parent.memory_size
    npages = size // PAGE
    layers = parent.layers
    mapping = gm.find_mapping(pid, workdir / wd.BASE_MEMORY, size)
    since = write_tracking.take(workdir, pid)
    written = write_tracking.written_runs(pid, mapping)  # and protected again
    compact = memory_compaction.compacts_inline(len(layers) - 1, max_chain)  # the valve
    tracked = written is not None and since == parent_dir and incremental and not compact
    runs = gm.private_runs(pid, mapping)
    if tracked and written is not None:
        # The record also names pages the guest only read into its mapping since (they
        # came in unprotected): a page it wrote is private too.
        runs = gm.intersect_runs(runs, written)
    private = sum(n for _, n in runs)
    t.mark("scan")
    full = not incremental or (compact and private > FULL_FRACTION * npages)
    ref_fds = [os.open(la.path, os.O_RDONLY) for la in layers]
    try:
        if full:
            writer = snap.LayerWriter(staging, size, "full", base=layers[0].path)
            owners = None
        else:
            writer = snap.LayerWriter(staging, size, "diff")
            # Compacting: the new diff sits on the base alone, so compare with the base.
            owners = bytearray(npages) if compact else snap.owner_map(layers, npages)
        t.mark("prepare")
        with gm.ProcessMemory(pid, mapping) as mem:
            _write_changed(mem, writer, runs, owners, ref_fds, check)
        layer = writer.close()
    finally:
        for fd in ref_fds:
            os.close(fd)
    t.mark("copy")
    phases = t.phases
    armed = written is not None
    nbytes = writer.pages * PAGE
    if full:
        return _MemoryResult((layer,), nbytes, True, phases, "full", armed)
    base = (layers[0],) if compact else layers
    if layer.pages == 0:
        (staging / snap.MEMORY).unlink()
        (staging / snap.MEMORY_RUNS).unlink()
        return _MemoryResult(base, 0, compact, phases, "none", armed)
    return _MemoryResult((*base, layer), nbytes, compact, phases, "diff", armed)


async def _switch_drive(vm: QemuVM, p: _DrivePlan, staging: Path) -> None:
    """While frozen: the current top becomes the snapshot's layer, the VM continues on a
    new one (qcow2), or gets a reflink copy taken (raw)."""
    assert p.top is not None and p.file is not None
    dest = staging / p.file
    if p.format == "raw":
        try:
            reflink(p.top, dest)
        except OSError as e:
            raise NotSupportedError(f"drive {p.id}: a running snapshot of a raw drive needs "
                                    f"reflink support ({e.strerror})", vm_id=vm.vm_id) from e
        return
    try:
        os.link(p.top, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        snap.copy_sparse(p.top, dest)  # snapshots on another filesystem: a real copy
    await vm.execute("blockdev-snapshot-sync", {"device": p.id, "snapshot-file": p.new_top,
                                                 "format": "qcow2", "mode": "existing"})
    # The frozen top is the snapshot's now; the VM keeps its open fd, read-only from here.
    Jail.take_back(dest)


async def _switch_back(vm: QemuVM, p: _DrivePlan, old_top: str) -> None:
    """The undo of ``_switch_drive`` for a qcow2 drive whose capture failed: an active
    commit (``block-commit``, then ``block-job-complete``) of the new overlay into the old
    top, so the VM writes the file its lineage names again and nothing it wrote since the
    switch is lost. The new overlay's header names a snapshot file that now never exists,
    so it cannot simply be kept. No-op when the switch did not happen or the VMM is gone.
    ``old_top``: the old top's name in the working directory, as QEMU opened it."""
    if not vm.is_alive() or await _top_file(vm, p.id) != p.new_top:
        return
    assert p.top is not None and p.new_top is not None
    vm.jail.give(p.top)  # the switch gave the frozen top to root; QEMU reopens it to write
    nodes = (await vm.execute("query-named-block-nodes", {"flat": True}))["return"]
    base = [n["node-name"] for n in nodes
            if n["drv"] == "qcow2" and _file_name(n["file"]) == old_top]
    if len(base) != 1:
        raise VMError(f"drive {p.id}: no single block node for {old_top} ({len(base)})",
                      vm_id=vm.vm_id)
    job = f"aenv-undo-{p.id}"
    await vm.execute("block-commit", {"job-id": job, "device": p.id, "base-node": base[0]})
    await _wait_job(vm, job, ready=True)
    await vm.execute("block-job-complete", {"device": job})
    await _wait_job(vm, job, ready=False)
    if await _top_file(vm, p.id) != old_top:
        raise VMError(f"drive {p.id}: the commit back into {old_top} did not complete",
                      vm_id=vm.vm_id)
    (vm.workdir / p.new_top).unlink(missing_ok=True)


async def _top_file(vm: QemuVM, drive_id: str) -> str | None:
    """The file name of the drive's active layer as QEMU has it (None: no such drive)."""
    for b in (await vm.execute("query-block"))["return"]:
        if b["device"] == drive_id and "inserted" in b:
            return _file_name(b["inserted"]["file"])
    return None


def _file_name(name: str) -> str:
    """A block node's file name; QEMU spells a node whose chain is not its header's as
    ``json:{...}`` with the name inside."""
    if name.startswith("json:"):
        return str(json.loads(name.removeprefix("json:"))["file"]["filename"])
    return name


async def _wait_job(vm: QemuVM, job: str, *, ready: bool, timeout: float = 60.0) -> None:
    """Until block job ``job`` is ready (``ready``) or gone (not ``ready``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = {j["device"]: j for j in (await vm.execute("query-block-jobs"))["return"]}
        if ready and jobs.get(job, {}).get("ready"):
            return
        if job not in jobs:
            if ready:
                raise VMError(f"block job {job} ended before it was ready", vm_id=vm.vm_id)
            return
        await asyncio.sleep(0.02)
    raise VMError(f"block job {job} did not {'get ready' if ready else 'end'} within "
                  f"{timeout:.0f} s", vm_id=vm.vm_id)


async def _save_device_state(vm: QemuVM, path: Path) -> None:
    """``xen-save-devices-state`` into ``path`` through a passed fd: a confined QEMU can
    neither see nor create ``path``. The fd joins a QEMU fd set for the one command."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    fdset: int | None = None
    try:
        vm.send_fd(fd)
        reply = await vm.execute("add-fd", {})
        fdset = int(reply["fdset-id"])
        await vm.execute("xen-save-devices-state",
                          {"filename": f"/dev/fdset/{fdset}", "live": False})
    finally:
        os.close(fd)
        if fdset is not None and vm.is_alive():
            try:
                await vm.execute("remove-fd", {"fdset-id": fdset})
            except VMError:
                pass  # the set goes with the VMM; a leak of one fd at worst


async def _frozen(vm: QemuVM) -> bool:
    try:
        return await vm.status() == "paused"
    except VMError:
        return False


def _take_drive(p: _DrivePlan, staging: Path) -> None:
    """Pause, vCPUs stopped (``stop`` flushed the image format's metadata to the file):
    the top joins the snapshot as a hard link; the VM's own name goes once the VMM has
    quit after the commit, so a crash in between leaves the VM whole."""
    assert p.top is not None and p.file is not None
    try:
        os.link(p.top, staging / p.file)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        snap.copy_sparse(p.top, staging / p.file)
    Jail.take_back(staging / p.file)


def _flatten(p: _DrivePlan, staging: Path, *, shared: bool) -> None:
    """Cut the drive's chain back to its root. ``shared``: the file is still the running
    VM's backing (a hard link), so flatten a copy and put that in its place."""
    path = staging / p.file  # type: ignore[operator]
    if shared:
        tmp = path.with_name(path.name + ".flat")
        snap.copy_sparse(path, tmp)
        snap.flatten_onto(tmp, p.root, p.root_format)
        os.replace(tmp, path)
    else:
        snap.flatten_onto(path, p.root, p.root_format)
    p.chain = ()


class QemuCapture(CaptureSteps):
    """``QemuVM.snapshot`` as the steps of ``aenv.runtime.snapshot_recipe`` (what each one
    does to memory and drives: the module docstring). ``phases``: the recipe's steps, and
    finer ones within them: ``plan_files``, ``plan_drives`` and ``plan_status`` (of
    ``plan``), ``memory_scan``, ``memory_prepare`` and ``memory_copy`` (of ``save_memory``,
    for a restored VM), ``commit_compact`` (flattening the drives of a full snapshot, after
    the thaw) and ``commit_durable`` (``snapshots.commit``: fsyncs and the rename) of
    ``commit``. A pause (``stop``) stays frozen from ``freeze`` until
    its VMM quits in ``finish``; ``freeze_s`` counts until the capture was complete
    (``thaw``)."""

    def __init__(self, vm: QemuVM, max_chain: int,
                 defer: dict[str, Any] | None = None) -> None:
        self.vm = vm
        self.vm_id = vm.vm_id
        self.workdir = vm.workdir
        self.max_chain = max_chain
        self.was_running = False
        # A pause that may leave a restored VM's memory to ``QemuDeferredMemory``: the
        # caller's note for the marker (``snapshots.PendingMemory.note``).
        self.defer = defer
        self.deferred = False

    def is_alive(self) -> bool:
        return self.vm.is_alive()

    async def plan(self, c: Capture) -> None:
        """The machine record, lineage and parent manifest; the staging directory; each
        drive's plan, with the overlays a running VM switches to made now (qemu-img takes
        ~20 ms a call); whether the vCPUs run. Finer phases within ``plan``: ``plan_files``
        (records, manifest, staging directory), ``plan_drives``, ``plan_status`` (QMP)."""
        vm = self.vm
        t = PhaseTimer()
        self.machine = read_machine(vm.workdir)
        if not self.machine.memory_file:
            raise NotSupportedError("snapshots need guest RAM in a file (VMSpec.memory_file)",
                                    vm_id=vm.vm_id)
        self.lineage = Lineage.load(vm.workdir, self.machine)
        self.parent = snap.read_manifest(self.lineage.parent) if self.lineage.parent else None
        if self.lineage.memory == "private" and self.parent is None:
            raise SnapshotError(f"{vm.vm_id} was restored but its snapshot is gone",
                                vm_id=vm.vm_id)
        self.staging = staging = snap.begin(c.directory)
        c.undo.push("the staging directory", lambda: snap.abort(staging))
        t.mark("plan_files")
        self.plans = await asyncio.to_thread(
            _plan_drives, vm.workdir, self.machine, self.lineage, self.parent, c.directory,
            stop=c.stop, incremental=c.incremental, max_chain=self.max_chain, jail=vm.jail)
        t.mark("plan_drives")
        self.was_running = await vm.status() == "running"
        t.mark("plan_status")
        c.timer.add(t.phases)

    async def freeze(self, c: Capture) -> None:
        """QMP ``stop`` when the vCPUs run (``stop`` also flushes the image format's
        metadata into the drive files)."""
        if self.was_running:
            c.undo.push("the freeze", self._unfreeze)
            await self.vm.execute("stop")

    async def _unfreeze(self) -> None:
        """The freeze's undo: the vCPUs run again, if the VMM is there and still stopped."""
        if self.vm.is_alive() and await _frozen(self.vm):
            await self.vm.execute("cont")

    async def save_state(self, c: Capture) -> None:
        await _save_device_state(self.vm, self.staging / snap.DEVICE_STATE)

    async def save_memory(self, c: Capture) -> None:
        """A restored VM: the pages it wrote, against its parent's stack; a booted one: a
        sparse copy of its RAM file."""
        vm = self.vm
        if self.lineage.memory == "private" and c.stop and self.defer is not None:
            # Deferred: the manifest names the parent's layers until the marker goes.
            assert self.parent is not None
            snap.write_pending(self.staging, snap.PendingMemory(
                vm.workdir, c.incremental, self.defer))
            self.mem = _MemoryResult(self.parent.layers, 0, method="deferred")
            self.deferred = True
        elif self.lineage.memory == "private":
            assert self.parent is not None
            assert self.lineage.parent is not None
            self.mem = await asyncio.to_thread(
                _capture_private, vm.pid, vm.workdir, self.staging, self.parent,
                self.lineage.parent, incremental=c.incremental, max_chain=self.max_chain)
        else:
            self.mem = await asyncio.to_thread(_capture_shared, vm.workdir, self.staging)

    async def drives(self, c: Capture) -> None:
        """A pause links each writable top into the snapshot (the VM's own name goes in
        ``finish``); a running snapshot switches the VM onto its new overlay."""
        for p in self.plans:
            if p.read_only:
                continue
            if c.stop:
                await asyncio.to_thread(_take_drive, p, self.staging)
                continue
            if p.new_top is not None:  # pushed first: the switch may fail half-way
                c.undo.push(f"the switch of drive {p.id}", functools.partial(
                    _switch_back, self.vm, p, self.lineage.tops[p.id]))
            await _switch_drive(self.vm, p, self.staging)

    async def thaw(self, c: Capture) -> None:
        if self.was_running and not c.stop:
            await self.vm.execute("cont")
            c.undo.drop("the freeze")

    async def commit(self, c: Capture) -> Captured:
        """Flatten the drives of a full (``incremental=False``) snapshot (off the freeze:
        O(data in the chain)), then the manifest and ``snapshots.commit``. Chains that grew
        too deep are compacted later, in the background (``prepare_compaction``)."""
        compacting = PhaseTimer()
        for p in self.plans:
            if p.flatten:
                try:
                    await asyncio.to_thread(_flatten, p, self.staging, shared=True)
                except StorageError as e:
                    # The VM may already run on an overlay that names this snapshot's
                    # file: keep the snapshot, one layer deeper than the limit.
                    log.warning("snapshot %s: compacting drive %s failed, kept as is: %s",
                                c.directory, p.id, e, extra={"vm_id": self.vm_id})
                    p.flatten = False
        c.timer.add({"commit_compact": compacting.elapsed()})
        mem, staging = self.mem, self.staging
        sizes = {
            "device_state": snap.allocated(staging / snap.DEVICE_STATE),
            "memory": snap.allocated(staging / snap.MEMORY),
            "disks": sum(snap.allocated(staging / p.file) for p in self.plans if p.file),
        }
        c.phases.update({f"memory_{k}": v for k, v in mem.phases.items()})
        manifest = snap.Manifest(
            driver=DRIVER, vm=self.machine.to_json(), memory_size=self.machine.memory_size,
            layers=tuple(_relocate(la, staging, c.directory) for la in mem.layers),
            drives=tuple(p.image() for p in self.plans), parent=self.lineage.parent,
            sizes=sizes, timings=c.phases)
        durable = PhaseTimer()
        snap.commit(staging, c.directory, manifest)
        c.timer.add({"commit_durable": durable.elapsed()})  # within ``commit``
        return Captured(parent=manifest.parent, memory_bytes=mem.written,
                        memory_layers=len(manifest.layers), disk_bytes=sizes["disks"],
                        compacted=mem.compacted or any(p.flatten for p in self.plans),
                        method=mem.method)

    async def finish(self, c: Capture) -> None:
        """A pause: the VMM quits, then the VM's own names of the drive tops it moved into
        the snapshot go (a crash before this leaves a frozen VM to re-attach). A running
        VM: the lineage names the snapshot and the overlays it runs on now."""
        if c.stop and self.deferred:
            return  # frozen, for QemuDeferredMemory.write
        if c.stop:
            c.vmm_stopped = True
            await self.vm.stop()
            for p in self.plans:
                if not p.read_only and p.top is not None:
                    p.top.unlink(missing_ok=True)
            return
        self.lineage.parent = c.directory
        for p in self.plans:
            if p.new_top is not None:
                self.lineage.tops[p.id] = p.new_top
        self.lineage.generation += 1
        self.lineage.save(self.vm.workdir)
        if self.mem.armed:
            write_tracking.remember(self.vm.workdir, self.vm.pid, c.directory)


async def capture(vm: QemuVM, directory: Path, *, stop: bool, incremental: bool,
                  max_chain: int) -> SnapshotInfo:
    """``QemuVM.snapshot``: see ``aenv.runtime.base.VM.snapshot`` and the module docstring."""
    return await snapshot_recipe.capture(QemuCapture(vm, max_chain), directory, stop=stop,
                                         incremental=incremental)


async def capture_deferred(vm: QemuVM, directory: Path, *, note: dict[str, Any],
                           max_chain: int) -> tuple[SnapshotInfo, QemuDeferredMemory | None]:
    """``QemuVM.pause_deferred``: a pause whose memory, for a restored VM, is written after
    the answer by the returned ``QemuDeferredMemory`` (a booted VM's pause is whole here).
    See the module docstring's "Deferred memory"."""
    steps = QemuCapture(vm, max_chain, defer=note)
    info = await snapshot_recipe.capture(steps, directory, stop=True, incremental=True)
    if not steps.deferred:
        return info, None
    return info, QemuDeferredMemory(vm, directory, max_chain)


class _Abandoned(Exception):
    """Raised in a deferred write's thread once the write was abandoned."""


class _WriteGate:
    """Who has a deferred pause's frozen VMM: the memory write, until it commits (the
    manifest and marker; or, failed, it ends the VMM), or a resume that abandoned it
    first. The lock is held only to flip the flags, from either thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.abandoned = False
        self.closed = False  # the write commits or ends the VMM: too late to abandon

    def check(self) -> None:
        if self.abandoned:
            raise _Abandoned()

    def close(self) -> bool:
        """The write's side: False when abandoned first."""
        with self._lock:
            if self.abandoned:
                return False
            self.closed = True
            return True

    def abandon(self) -> bool:
        """The resume's side: False when the write closed first."""
        with self._lock:
            if self.closed:
                return False
            self.abandoned = True
            return True


class QemuDeferredMemory(DeferredMemory):
    """The memory half of a deferred pause (``aenv.runtime.base.DeferredMemory``): the
    frozen VMM's written pages into the committed snapshot ``directory``. Phases:
    ``memory_scan``, ``memory_prepare``, ``memory_copy`` (as a capture's), ``memory_fsync``
    and ``manifest`` (the layer made durable and named), ``vmm_stop``.

    ``abandon`` (a resume in place) wins until the write closes its gate (just before the
    manifest is rewritten, or before a failed write ends the VMM); the copy checks the
    gate before each 8 MiB chunk, so an abandon waits for one chunk at most."""

    vm: QemuVM

    def __init__(self, vm: QemuVM, directory: Path, max_chain: int) -> None:
        self.vm = vm
        self.directory = directory
        self.max_chain = max_chain
        self._gate = _WriteGate()
        self._copy: asyncio.Task[dict[str, float]] | None = None

    def _abandoned(self) -> MemoryWriteAbandoned:
        return MemoryWriteAbandoned(f"the memory write of {self.directory.name} was "
                                    "abandoned: its VM was resumed in place",
                                    vm_id=self.vm.vm_id)

    async def write(self) -> dict[str, float]:
        vm = self.vm
        if self._gate.abandoned:
            raise self._abandoned()
        tops = _own_tops(vm.workdir)
        error: BaseException | None = None
        phases: dict[str, float] = {}
        self._copy = asyncio.ensure_future(asyncio.to_thread(
            _write_pending_memory, vm.pid, vm.workdir, self.directory, self.max_chain,
            self._gate))
        try:
            phases = await asyncio.shield(self._copy)
        except _Abandoned:
            raise self._abandoned() from None
        except Exception as e:
            if not self._gate.close():
                raise self._abandoned() from e
            error = e
        t = PhaseTimer()
        await vm.stop()
        for top in tops:  # the snapshot holds them now (``_take_drive``)
            top.unlink(missing_ok=True)
        phases["vmm_stop"] = t.elapsed()
        if error is not None:
            raise SnapshotError(f"memory of the pause of {vm.vm_id} into {self.directory} "
                                f"was not written: {error}", vm_id=vm.vm_id,
                                vm_lost=True) from error
        log.info("pause %s: memory written after the answer (%s)", self.directory.name,
                 ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()),
                 extra={"vm_id": vm.vm_id, "op": "pause_memory",
                        "duration": sum(phases.values())})
        return phases

    async def abandon(self) -> bool:
        """``DeferredMemory.abandon``: after the gate, the copy (if it runs) is waited for,
        then ``_abandon_files``; the VMM stays frozen for the caller's ``resume``."""
        if not self._gate.abandon():
            return False
        # (Called again for a VMM adopted after a restart that cut an abandon short: the
        # gate is new, the files' steps are idempotent.)
        if self._copy is not None:
            await asyncio.wait([self._copy])
        await asyncio.to_thread(_abandon_files, self.vm, self.directory)
        log.info("pause %s: abandoned for a resume in place", self.directory.name,
                 extra={"vm_id": self.vm.vm_id, "op": "resume_in_place"})
        return True


def _abandon_files(vm: QemuVM, directory: Path) -> None:
    """The marker renamed (``snapshots.abandon_pending``: from here a restart takes the
    VMM for the running sandbox), an interrupted copy's layer files removed, and the
    drive tops given back to the VM's uid. The pause had linked each top into the
    snapshot and given it to root (``_take_drive``): the VMM writes on through the fd it
    has, and a later capture that reopens the file by name needs it to be the VM's. The
    snapshot's names of those tops stay until collection removes the snapshot; nothing
    reads them (the abandoned snapshot is never restored, compacted nor published).
    Once more after a restart that cut it after the rename: the rest is idempotent."""
    if snap.memory_pending(directory):
        snap.abandon_pending(directory)
    elif not snap.memory_abandoned(directory):
        raise SnapshotError(f"{directory}: no pending memory to abandon", vm_id=vm.vm_id)
    for name in (snap.MEMORY, snap.MEMORY_RUNS):
        (directory / name).unlink(missing_ok=True)
    for top in _own_tops(vm.workdir):
        vm.jail.give(top)


def _own_tops(workdir: Path) -> list[Path]:
    """The real paths of a VM's writable drive tops, as its lineage names them."""
    try:
        machine = read_machine(workdir)
        lineage = Lineage.load(workdir, machine)
    except (SnapshotError, OSError, ValueError, KeyError):
        return []
    return [(workdir / lineage.tops[d.id]).resolve() for d in machine.drives
            if not d.read_only and d.id in lineage.tops]


def _write_pending_memory(pid: int, workdir: Path, directory: Path, max_chain: int,
                          gate: _WriteGate | None = None) -> dict[str, float]:
    """The memory layer of the deferred pause ``directory`` from the frozen VMM ``pid``,
    exactly as ``save_memory`` would have written it; then, in this order, the layer's
    files fsynced, the manifest rewritten to name it (atomically, durably) and the marker
    removed. A crash before the marker's removal leaves it: a restarted server writes the
    layer again from the VMM (the leftovers of this attempt are removed first), or, with
    the VMM gone, the snapshot stays unrestorable. ``gate``: raises ``_Abandoned`` when a
    resume took the VMM back before the manifest was rewritten."""
    check = gate.check if gate is not None else None
    if check is not None:
        check()
    pending = snap.read_pending(directory)
    if pending is None:
        raise SnapshotError(f"{directory} has no pending memory")
    manifest = snap.read_manifest(directory)
    if manifest.parent is None:
        raise SnapshotError(f"{directory}: a deferred pause without a parent snapshot")
    parent = snap.read_manifest(manifest.parent)
    for name in (snap.MEMORY, snap.MEMORY_RUNS):
        (directory / name).unlink(missing_ok=True)
    mem = _capture_private(pid, workdir, directory, parent, manifest.parent,
                           incremental=pending.incremental, max_chain=max_chain, check=check)
    t = PhaseTimer()
    for name in (snap.MEMORY, snap.MEMORY_RUNS):
        if (directory / name).exists():
            durable.fsync_file(directory / name)
    t.mark("fsync")
    if gate is not None and not gate.close():
        raise _Abandoned()
    sizes = {**manifest.sizes, "memory": snap.allocated(directory / snap.MEMORY)}
    timings = {**manifest.timings, **{f"memory_{k}": v for k, v in mem.phases.items()}}
    snap.rewrite_manifest(directory, dataclasses.replace(
        manifest, layers=mem.layers, sizes=sizes, timings=timings))
    (directory / snap.MEMORY_PENDING).unlink()
    durable.fsync_dir(directory)
    t.mark("manifest")
    return {**{f"memory_{k}": v for k, v in mem.phases.items()},
            **{f"memory_{k}": v for k, v in t.phases.items()}}


def _relocate(layer: snap.MemoryLayer, staging: Path, directory: Path) -> snap.MemoryLayer:
    """Layers written into the staging directory are this snapshot's own."""
    if layer.directory == staging:
        return snap.MemoryLayer(directory, layer.kind, layer.pages)
    return layer


# -- restore ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestorePlan:
    snapshot_dir: Path
    manifest: snap.Manifest
    spec: VMSpec  # ``memory_file`` is the base image the VM maps copy-on-write
    machine: QemuMachine

    @property
    def accel(self) -> Accel:
        return self.machine.accel

    @property
    def device_state(self) -> Path:
        return self.snapshot_dir / snap.DEVICE_STATE


def prepare_restore(snapshot_dir: Path, overrides: RestoreOverrides) -> RestorePlan:
    """Read the snapshot and lay out the new working directory: fixed names for the kernel
    and each drive (a new copy-on-write layer over the snapshot's), ``base-memory`` linked
    to the base image, and the lineage that makes the VM's next snapshot incremental."""
    try:
        manifest = snap.read_manifest(snapshot_dir)
    except StorageError as e:
        raise SnapshotError(str(e), vm_id=overrides.vm_id) from e
    if manifest.driver != DRIVER:
        raise SnapshotError(f"{snapshot_dir} was taken by the {manifest.driver} driver",
                            vm_id=overrides.vm_id)
    if snap.memory_pending(snapshot_dir) or snap.memory_abandoned(snapshot_dir):
        raise SnapshotError(f"{snapshot_dir}: its memory layer is incomplete (a pause's "
                            "memory is still being written, was never finished, or was "
                            "abandoned for a resume in place)", vm_id=overrides.vm_id)
    m = QemuMachine.from_json(manifest.vm, snapshot_dir / snap.MANIFEST)
    workdir = overrides.workdir
    if workdir.exists() and any(workdir.iterdir()):
        raise SnapshotError(f"{workdir} is not empty", vm_id=overrides.vm_id)
    drives = []
    try:
        for d in manifest.drives:
            if d.read_only:
                assert d.path is not None
                drives.append(Drive(d.id, d.path, read_only=True, format=d.format))
            elif d.id in overrides.drives:
                path = overrides.drives[d.id]
                drives.append(Drive(d.id, path, format="qcow2" if path.suffix == ".qcow2"
                                    else "raw"))
            else:
                disk = create_disk(snapshot_dir / (d.file or ""), workdir, name=d.id)
                drives.append(Drive(d.id, disk.path, format=disk.format))
    except (DiskError, StorageError) as e:
        raise SnapshotError(f"cannot make the drives of {overrides.vm_id}: {e}",
                            vm_id=overrides.vm_id) from e
    spec = VMSpec(
        vm_id=overrides.vm_id, workdir=workdir, kernel=m.kernel, boot_args=m.boot_args,
        drives=tuple(drives), initrd=m.initrd, vcpus=m.vcpus, memory_mib=m.memory_mib,
        tap=(overrides.tap or m.tap) if m.tap else None, netns=overrides.netns, mac=m.mac,
        memory_file=manifest.layers[0].path, console_log=overrides.console_log,
    )
    wd.prepare(dataclasses.replace(spec, memory_file=None))
    base = workdir / wd.BASE_MEMORY
    base.unlink(missing_ok=True)
    base.symlink_to(manifest.layers[0].path)
    tops = {d.id: wd.drive_name(d) for d in drives if not d.read_only}
    Lineage("private", snapshot_dir, tops).save(workdir)
    return RestorePlan(snapshot_dir, manifest, spec, m)


def apply_memory(pid: int, plan: RestorePlan, *, track: bool = False) -> int:
    """Write the diff layers over the freshly mapped base, before the device state is
    loaded (virtio's load reads its rings from guest RAM); each page is written once, from
    the newest layer that has it. Returns the pages written. ``track``: the VMM runs with
    ``write_tracking``'s library; its record then starts here, at the restored snapshot (the
    pages just written are that snapshot's), so even the first capture compares only what
    the guest wrote since."""
    layers = plan.manifest.layers
    size = plan.manifest.memory_size
    if len(layers) == 1 and not track:
        return 0
    mapping = gm.find_mapping(pid, plan.spec.workdir / wd.BASE_MEMORY, size)
    written = _write_layers(pid, mapping, layers, size) if len(layers) > 1 else 0
    if track and write_tracking.written_runs(pid, mapping) is not None:
        write_tracking.remember(plan.spec.workdir, pid, plan.snapshot_dir)
    return written


def _write_layers(pid: int, mapping: gm.Mapping, layers: tuple[snap.MemoryLayer, ...],
                  size: int) -> int:
    owners = snap.owner_map(layers, size // PAGE)
    written = 0
    with gm.ProcessMemory(pid, mapping, write=True) as mem:
        for index in range(1, len(layers)):
            fd = os.open(layers[index].path, os.O_RDONLY)
            try:
                runs = list(snap.runs_where(owners, index))
                for start, count in gm.split_runs(runs, _CHUNK_PAGES):
                    mem.write(start, _pread(fd, count * PAGE, start * PAGE))
                    written += count
            finally:
                os.close(fd)
    return written


# -- compaction (after the capture) -------------------------------------------------------------

COMPACTING = ".compacting"  # the flattened copy of a drive file, beside it, until installed


@dataclass(frozen=True)
class _FlatDrive:
    id: str
    file: Path  # the snapshot's drive file
    flat: Path | None  # its flattened copy, fsynced; None: the file is flat already
    root: Path | None


class QemuCompaction(Compaction):
    """``prepare_compaction``'s result (the steps: ``aenv.runtime.base.Compaction``)."""

    def __init__(self, directory: Path, drives: tuple[_FlatDrive, ...],
                 memory: memory_compaction.MemoryCompaction | None = None) -> None:
        self.directory = directory
        self.drives = drives
        self.memory = memory  # the merge of the memory stack, if it is too deep

    def install(self) -> bool:
        if not (self.directory / snap.MANIFEST).is_file():  # collected meanwhile
            self.discard()
            return False
        for d in self.drives:
            if d.flat is not None:
                os.replace(d.flat, d.file)
        durable.fsync_dir(self.directory)
        if self.memory is not None and not self.memory.install():
            return bool(self.drives)
        return True

    def release(self) -> None:
        if self.memory is not None:
            self.memory.release()
        try:
            manifest = snap.read_manifest(self.directory)
        except StorageError:
            return  # collected meanwhile
        flat = {d.id for d in self.drives
                if (info := snap.qcow2_info(d.file)) is not None and info.backing == d.root}
        drives = tuple(dataclasses.replace(d, chain=()) if d.id in flat else d
                       for d in manifest.drives)
        if drives != manifest.drives:
            snap.rewrite_manifest(self.directory, dataclasses.replace(manifest, drives=drives))

    def discard(self) -> None:
        if self.memory is not None:
            self.memory.discard()
        for d in self.drives:
            if d.flat is not None:
                d.flat.unlink(missing_ok=True)


def prepare_compaction(directory: Path, max_chain: int) -> QemuCompaction | None:
    """``QemuRuntime.prepare_compaction``: each qcow2 drive of snapshot ``directory`` whose
    file reads through more than ``max_chain`` - 1 other snapshots' files is flattened onto
    its root into ``.<file>.compacting`` (made from a copy: the file may be a running VM's
    backing) and fsynced. A drive whose file is already flat (a compaction installed but
    not released when the server stopped) needs only the release. The memory stack, when
    deeper than ``max_chain`` diffs, is merged (``memory_compaction.prepare``)."""
    try:
        manifest = snap.read_manifest(directory)
    except StorageError:
        return None
    if manifest.driver != DRIVER:
        return None
    drives: list[_FlatDrive] = []
    try:
        for d in manifest.drives:
            if d.read_only or d.format != "qcow2" or d.file is None or not d.chain:
                continue
            path = directory / d.file
            flat = path.with_name(f".{d.file}{COMPACTING}")
            flat.unlink(missing_ok=True)  # an interrupted compaction's
            if len(d.chain) + 1 <= max_chain:
                continue
            info = snap.qcow2_info(path)
            if info is not None and info.backing == d.root:
                drives.append(_FlatDrive(d.id, path, None, d.root))
                continue
            drives.append(_FlatDrive(d.id, path, flat, d.root))
            snap.copy_sparse(path, flat)
            os.chmod(flat, path.stat().st_mode & 0o777)
            snap.flatten_onto(flat, d.root, d.root_format)
            durable.fsync_file(flat)
        memory = memory_compaction.prepare(directory, max_chain)
    except BaseException:
        QemuCompaction(directory, tuple(drives)).discard()
        raise
    if not drives and memory is None:
        return None
    return QemuCompaction(directory, tuple(drives), memory)
