"""The on-disk layout of a VM snapshot directory, shared by every runtime driver.

A snapshot directory holds::

    snapshot.json   the manifest (written last, atomically: a directory without it is
                    not a snapshot)
    vmstate         the VMM's device state (format owned by the driver that wrote it)
    memory          this snapshot's memory layer (absent when nothing changed)
    memory.runs     for a diff layer: which pages ``memory`` holds
    memory.merged (+ ``.runs``)  a diff layer made by merging the snapshot's diff layers
                    in the background (``aenv.storage.memory_compaction``); the manifest
                    then names it in the place of those layers
    memory.pending  present while the memory layer is still being written after a pause
                    answered (``memory_pending``); the manifest then names the parent's
                    layers only, and the snapshot must not be restored
    memory.abandoned  the same marker, renamed when a resume continued the frozen VMM in
                    place instead (``abandon_pending``): the snapshot is never restored,
                    never written, and goes when no record names it
    <drive>.<fmt>   this snapshot's layer of each writable drive (e.g. ``rootfs.qcow2``)

**Memory is a stack of layers**, base first. Layer 0 is *full*: a sparse file of the guest
RAM size whose every page is valid (holes read as zeros). Each later layer is a *diff*: a
sparse file of the same size in which only the pages listed in ``memory.runs`` are valid,
each at its own offset (page ``p`` at ``p * PAGE_SIZE``), so the bytes of any page are found
without an index lookup. The guest's memory is the base with every diff applied in order.
A restore maps the base copy-on-write and writes the diff pages over it; a snapshot of a
restored VM writes only pages that differ from the stack it came from. Layers of other
snapshots are referenced by their directory (absolute path), as qcow2 references its
backing file: a snapshot must not be moved or deleted while another one depends on it
(``dependencies`` lists them, for the caller's garbage collection).

``memory.runs`` is little-endian uint32 pairs ``(first_page, page_count)``, sorted and
disjoint. No checksums: computing one would cost a pass over data the pause otherwise
never reads (pause must cost what changed, not what exists); files are written by this
host and the manifest records their sizes, which ``read_manifest`` checks.

A manifest may also list ``retired`` layer files: ones an earlier version of it named
(before a background merge) that a reader of that version may still open. Garbage
collection keeps them until the merge's release drops them from the list.

Durability: ``commit`` fsyncs every file of the snapshot and its manifest, then renames
the directory into place and fsyncs the parent (``durable``), so a snapshot that exists
after a host crash holds what was captured, never zeros. The manifest carries
``FORMAT_VERSION``, or ``NAMED_LAYERS_VERSION`` when a layer has a file name other than
``memory`` (an older aenv would read the wrong file, so it must refuse such a manifest); a
reader refuses versions it does not know (``READ_VERSIONS``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import durable
from ._run import run
from .errors import StorageError

FORMAT = "aenv-vm-snapshot"
FORMAT_VERSION = 1
NAMED_LAYERS_VERSION = 2  # written instead when a layer is not named ``memory``
READ_VERSIONS = (FORMAT_VERSION, NAMED_LAYERS_VERSION)
MANIFEST = "snapshot.json"
DEVICE_STATE = "vmstate"
MEMORY = "memory"
MEMORY_RUNS = "memory.runs"
MEMORY_PENDING = "memory.pending"
MEMORY_ABANDONED = "memory.abandoned"
PAGE_SIZE = 4096

LayerKind = Literal["full", "diff"]
Run = tuple[int, int]  # (first page, page count)


class SnapshotFilesError(StorageError):
    """A snapshot directory could not be written or read."""


class SnapshotFormatError(SnapshotFilesError):
    """The directory is not a complete snapshot of a format this code reads."""


# -- manifest ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryLayer:
    """One layer of the memory stack: the file ``name`` (``memory`` unless a background
    merge made it) of snapshot ``directory``."""

    directory: Path
    kind: LayerKind
    pages: int  # valid pages (for a full layer: the pages allocated in the sparse file)
    name: str = MEMORY

    @property
    def path(self) -> Path:
        return self.directory / self.name

    @property
    def runs_path(self) -> Path:
        return self.directory / f"{self.name}.runs"


@dataclass(frozen=True)
class DriveImage:
    """A drive as the snapshot keeps it.

    A writable drive has its own ``file`` in the snapshot directory; ``chain`` lists the
    files of *other* snapshots its backing chain passes through (newest first) and ``root``
    the read-only image the chain ends on (a template image or layer; None when the file
    is self-contained). A read-only drive is not copied: ``path`` is the shared image.
    """

    id: str
    format: Literal["raw", "qcow2"]
    read_only: bool
    file: str | None = None
    path: Path | None = None
    chain: tuple[Path, ...] = ()
    root: Path | None = None
    root_format: str | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything about a snapshot except its bulk data. ``vm`` is the driver's own record
    of the machine shape (what its restore needs to rebuild an identical VMM)."""

    driver: str
    vm: dict[str, Any]
    memory_size: int
    layers: tuple[MemoryLayer, ...]
    drives: tuple[DriveImage, ...]
    parent: Path | None = None
    created_at: float = field(default_factory=time.time)
    sizes: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Layer files an earlier version of this manifest named (a merge's, until its release).
    retired: tuple[Path, ...] = ()

    @property
    def npages(self) -> int:
        return self.memory_size // PAGE_SIZE

    @property
    def diff_depth(self) -> int:
        """How many diff layers sit on the base (0: the memory is one full file)."""
        return len(self.layers) - 1

    def drive(self, drive_id: str) -> DriveImage:
        for d in self.drives:
            if d.id == drive_id:
                return d
        raise KeyError(drive_id)

    def to_json(self, directory: Path) -> dict[str, Any]:
        def ref(p: Path) -> str | None:
            return None if p == directory else str(p)

        def layer(la: MemoryLayer) -> dict[str, Any]:
            out: dict[str, Any] = {"dir": ref(la.directory), "kind": la.kind, "pages": la.pages}
            if la.name != MEMORY:
                out["file"] = la.name
            return out

        named = any(la.name != MEMORY for la in self.layers)
        return {
            "format": FORMAT,
            "version": NAMED_LAYERS_VERSION if named else FORMAT_VERSION,
            "driver": self.driver,
            "created_at": self.created_at,
            "parent": str(self.parent) if self.parent else None,
            "vm": self.vm,
            "device_state": DEVICE_STATE,
            "memory": {
                "size": self.memory_size,
                "page_size": PAGE_SIZE,
                "layers": [layer(la) for la in self.layers],
                **({"retired": [str(p) for p in self.retired]} if self.retired else {}),
            },
            "drives": [
                {"id": d.id, "format": d.format, "read_only": d.read_only, "file": d.file,
                 "path": str(d.path) if d.path else None, "chain": [str(p) for p in d.chain],
                 "root": str(d.root) if d.root else None, "root_format": d.root_format}
                for d in self.drives
            ],
            "sizes": self.sizes,
            "timings": {k: round(v, 6) for k, v in self.timings.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], directory: Path) -> Manifest:
        if data.get("format") != FORMAT:
            raise SnapshotFormatError(f"{directory}: not an aenv VM snapshot")
        if data.get("version") not in READ_VERSIONS:
            raise SnapshotFormatError(
                f"{directory}: snapshot format version {data.get('version')}, "
                f"this aenv reads {FORMAT_VERSION}")
        mem = data["memory"]
        if mem["page_size"] != PAGE_SIZE:
            raise SnapshotFormatError(f"{directory}: page size {mem['page_size']}")
        layers = tuple(
            MemoryLayer(Path(la["dir"]) if la["dir"] else directory, la["kind"], la["pages"],
                        la.get("file", MEMORY))
            for la in mem["layers"])
        drives = tuple(
            DriveImage(d["id"], d["format"], d["read_only"], d["file"],
                       Path(d["path"]) if d["path"] else None,
                       tuple(Path(p) for p in d["chain"]),
                       Path(d["root"]) if d["root"] else None, d.get("root_format"))
            for d in data["drives"])
        return cls(driver=data["driver"], vm=data["vm"], memory_size=mem["size"],
                   layers=layers, drives=drives,
                   parent=Path(data["parent"]) if data["parent"] else None,
                   created_at=data["created_at"], sizes=data.get("sizes", {}),
                   timings=data.get("timings", {}),
                   retired=tuple(Path(p) for p in mem.get("retired", ())))


def read_manifest(directory: Path) -> Manifest:
    """The manifest of ``directory``, after checking that the files it names are there."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise SnapshotFormatError(f"{directory} is not a (complete) snapshot") from None
    except (OSError, ValueError) as e:
        raise SnapshotFormatError(f"{directory}: unreadable manifest: {e}") from e
    try:
        manifest = Manifest.from_json(data, directory)
    except (KeyError, TypeError) as e:
        raise SnapshotFormatError(f"{directory}: malformed manifest ({e})") from e
    for layer in manifest.layers:
        try:
            size = layer.path.stat().st_size
        except FileNotFoundError:
            raise SnapshotFormatError(f"{directory}: memory layer {layer.path} is missing") \
                from None
        if size != manifest.memory_size:
            raise SnapshotFormatError(f"{layer.path} is {size} bytes, "
                                      f"the guest has {manifest.memory_size}")
    for d in manifest.drives:
        p = directory / d.file if d.file else d.path
        if p is None or not p.exists():
            raise SnapshotFormatError(f"{directory}: drive {d.id} file {p} is missing")
    if not (directory / DEVICE_STATE).is_file():
        raise SnapshotFormatError(f"{directory}: {DEVICE_STATE} is missing")
    return manifest


def memory_pending(directory: Path) -> bool:
    """Whether the snapshot's memory layer is still to be written (``MEMORY_PENDING``): a
    pause answered before its memory was copied out of the frozen VMM (``aenv.runtime``'s
    ``VM.pause_deferred``). Such a snapshot restores only once the marker is gone."""
    return (directory / MEMORY_PENDING).exists()


@dataclass(frozen=True)
class PendingMemory:
    """What ``memory.pending`` says: the working directory of the frozen VMM that still
    holds the memory, whether the layer is incremental, and the caller's ``note`` (the
    node's: which network slot that VMM holds), so a restarted server can find and keep
    that VMM and finish the layer."""

    vm_dir: Path
    incremental: bool
    note: dict[str, Any]


def write_pending(directory: Path, pending: PendingMemory) -> None:
    """The marker, into a staging directory (``commit`` makes it durable with the rest)."""
    (directory / MEMORY_PENDING).write_text(json.dumps(
        {"vm_dir": str(pending.vm_dir), "incremental": pending.incremental,
         "note": pending.note}))


def read_pending(directory: Path, name: str = MEMORY_PENDING) -> PendingMemory | None:
    """The marker of ``directory``; None without one (or an unreadable one: a marker is
    written complete before the directory is committed, so that is not a snapshot's).
    ``name``: ``MEMORY_ABANDONED`` reads an abandoned one."""
    try:
        data = json.loads((directory / name).read_text())
        return PendingMemory(Path(data["vm_dir"]), bool(data["incremental"]),
                             dict(data.get("note") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def memory_abandoned(directory: Path) -> bool:
    """Whether a resume continued the pause's frozen VMM in place (``MEMORY_ABANDONED``):
    the snapshot's memory was never written and never will be."""
    return (directory / MEMORY_ABANDONED).exists()


def abandon_pending(directory: Path) -> None:
    """Rename ``memory.pending`` to ``memory.abandoned``, durably: one atomic step after
    which a restarted server no longer writes the memory from the VMM (nor ends it) but
    takes that VMM for the running sandbox it became."""
    os.replace(directory / MEMORY_PENDING, directory / MEMORY_ABANDONED)
    durable.fsync_dir(directory)


# -- directory lifecycle -------------------------------------------------------------------


def begin(directory: Path) -> Path:
    """A fresh staging directory beside ``directory`` (which must not exist yet); fill it,
    then ``commit``. Files referenced by absolute path (backing chains) must use the final
    ``directory`` path, which is where they will be read from."""
    if directory.exists():
        raise SnapshotFilesError(f"{directory} already exists")
    directory.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))


def commit(staging: Path, directory: Path, manifest: Manifest) -> None:
    """Write the manifest into ``staging``, make every file durable, and rename it to
    ``directory``: once this returns, the snapshot survives a host crash."""
    try:
        # Written plainly: nobody reads the staging directory, and fsync_tree flushes it
        # with the other files before the rename makes any of them visible.
        (staging / MANIFEST).write_bytes(
            json.dumps(manifest.to_json(directory), indent=1).encode())
        durable.fsync_tree(staging)
        durable.rename_durably(staging, directory)
    except OSError as e:
        raise SnapshotFilesError(f"cannot commit the snapshot at {directory}: {e}") from e


def rewrite_manifest(directory: Path, manifest: Manifest) -> None:
    """Replace the manifest of the complete snapshot ``directory`` (a compaction that
    shortened its chains), atomically and durably."""
    try:
        durable.write_atomic(directory / MANIFEST,
                             json.dumps(manifest.to_json(directory), indent=1).encode())
    except OSError as e:
        raise SnapshotFilesError(f"cannot rewrite the manifest of {directory}: {e}") from e


def abort(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def dependencies(directory: Path) -> set[Path]:
    """Other snapshot directories whose files ``directory`` reads (memory layers and drive
    backing chains, and retired layers a reader may still open): none of them may be
    deleted while ``directory`` exists."""
    m = read_manifest(directory)
    deps = {la.directory for la in m.layers} | {p.parent for d in m.drives for p in d.chain}
    deps |= {p.parent for p in m.retired}
    deps.discard(directory)
    return deps


def remove(directory: Path) -> None:
    """Delete a snapshot directory (the caller checked ``dependencies`` of the others)."""
    shutil.rmtree(directory, ignore_errors=True)


def allocated(path: Path) -> int:
    """Bytes a (sparse) file really occupies."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


# -- page runs ------------------------------------------------------------------------------


def write_runs(path: Path, runs: Sequence[Run]) -> None:
    flat = array("I")
    for start, count in runs:
        flat.append(start)
        flat.append(count)
    if flat.itemsize != 4:
        raise SnapshotFilesError("uint32 arrays are not 4 bytes on this platform")
    if sys.byteorder != "little":
        flat.byteswap()
    path.write_bytes(flat.tobytes())


def read_runs(path: Path) -> list[Run]:
    flat = array("I")
    flat.frombytes(path.read_bytes())
    if sys.byteorder != "little":
        flat.byteswap()
    return list(zip(flat[0::2], flat[1::2], strict=True))


_ONE_RUN = re.compile(rb"\x01+")


def runs_where(owners: bytes | bytearray, value: int) -> Iterator[Run]:
    """Maximal runs of pages whose owner byte equals ``value`` (C-speed: translate + re)."""
    table = bytes(1 if b == value else 0 for b in range(256))
    for m in _ONE_RUN.finditer(owners.translate(table)):
        yield m.start(), m.end() - m.start()


def owner_map(layers: Sequence[MemoryLayer], npages: int) -> bytearray:
    """For every page, the index of the layer whose copy is current (0 = the base).
    Diff layers are applied in order, so a later layer's page wins."""
    if len(layers) > 255:
        raise SnapshotFilesError("more than 255 memory layers")
    owners = bytearray(npages)
    for index, layer in enumerate(layers[1:], 1):
        mark = bytes([index])
        for start, count in read_runs(layer.runs_path):
            owners[start:start + count] = mark * count
    return owners


class LayerWriter:
    """Writes pages into a new sparse layer file of ``size`` bytes at their own offsets and
    records which pages it holds; ``close`` writes the runs file (diff layers only).

    A full layer may start as a sparse copy of an older full layer (``base``): the pages
    written then replace the copied ones.
    """

    def __init__(self, directory: Path, size: int, kind: LayerKind,
                 base: Path | None = None) -> None:
        self.directory = directory
        self.kind = kind
        self.pages = 0
        self._runs: list[list[int]] = []
        path = directory / MEMORY
        if base is not None:
            if kind != "full":
                raise ValueError("only a full layer starts from a base")
            copy_sparse(base, path)
            self._fd = os.open(path, os.O_WRONLY)
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(self._fd, size)

    def write(self, first_page: int, data: bytes | memoryview) -> None:
        count = len(data) // PAGE_SIZE
        if count == 0:
            return
        os.pwrite(self._fd, data, first_page * PAGE_SIZE)
        # Written back while the capture goes on: commit's fsync then waits for little.
        durable.start_writeback(self._fd, first_page * PAGE_SIZE, len(data))
        self.pages += count
        if self._runs and self._runs[-1][0] + self._runs[-1][1] == first_page:
            self._runs[-1][1] += count
        else:
            self._runs.append([first_page, count])

    def close(self) -> MemoryLayer:
        """Finish the layer. A full layer counts its allocated pages (copied + written)."""
        pages = self.pages
        if self.kind == "full":
            pages = os.fstat(self._fd).st_blocks * 512 // PAGE_SIZE
        os.close(self._fd)
        if self.kind == "diff":
            write_runs(self.directory / MEMORY_RUNS, [(s, n) for s, n in self._runs])
        return MemoryLayer(self.directory, self.kind, pages)


def copy_sparse(src: Path, dest: Path) -> int:
    """Copy ``src`` to a new ``dest`` of the same size, only its data extents (holes stay
    holes); returns the bytes copied. The copy runs in the kernel (``sendfile``)."""
    copied = 0
    with open(src, "rb") as s, open(dest, "xb") as d:
        size = os.fstat(s.fileno()).st_size
        os.ftruncate(d.fileno(), size)
        offset = 0
        while offset < size:
            try:
                start = os.lseek(s.fileno(), offset, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after offset
                break
            end = os.lseek(s.fileno(), start, os.SEEK_HOLE)
            os.lseek(d.fileno(), start, os.SEEK_SET)
            pos = start
            while pos < end:
                sent = os.sendfile(d.fileno(), s.fileno(), pos, end - pos)
                if sent == 0:
                    raise SnapshotFilesError(f"{src} shrank while being copied")
                pos += sent
            copied += end - start
            offset = end
    return copied


# -- drive layers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInfo:
    virtual_size: int
    backing: Path | None
    backing_format: str | None


def _qemu_img() -> str:
    binary = shutil.which("qemu-img")
    if binary is None:
        raise SnapshotFilesError("qemu-img is missing (apt-get install qemu-utils)")
    return binary


_QCOW2_MAGIC = b"QFI\xfb"
_QCOW2_BACKING_FORMAT = 0xE2792ACA  # header extension: the backing file's format


def qcow2_info(path: Path) -> ImageInfo | None:
    """``image_info`` of a qcow2 file read from its header in Python (no process: a snapshot
    plans its drives before the freeze, and ``qemu-img info`` costs ~20 ms of start-up).
    None when ``path`` is no qcow2 or names its backing in a way only QEMU resolves
    (``json:``); the caller then asks ``qemu-img``. A relative backing name is resolved
    against the image's directory, as QEMU does."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)  # the header and the backing name sit in cluster 0
    except OSError as e:
        raise SnapshotFilesError(f"cannot read {path}: {e}") from e
    if len(head) < 72 or head[:4] != _QCOW2_MAGIC:
        return None
    version, b_off, b_len, _, size = struct.unpack_from(">IQIIQ", head, 4)
    backing: Path | None = None
    fmt: str | None = None
    if b_off:
        raw = head[b_off:b_off + b_len]
        if len(raw) != b_len:
            return None
        name = raw.decode("utf-8", "surrogateescape")
        if name.startswith("json:") or ":" in name.split("/", 1)[0]:
            return None
        backing = Path(name) if name.startswith("/") else path.parent / name
    pos = struct.unpack_from(">I", head, 100)[0] if version >= 3 else 72
    while pos + 8 <= len(head):
        kind, length = struct.unpack_from(">II", head, pos)
        if kind == 0:
            break
        if kind == _QCOW2_BACKING_FORMAT:
            fmt = head[pos + 8:pos + 8 + length].decode("ascii", "replace")
        pos += 8 + (length + 7) // 8 * 8
    return ImageInfo(size, backing, fmt)


def image_info(path: Path) -> ImageInfo:
    """Virtual size and direct backing file of a disk image: from its header for a plain
    qcow2 (``qcow2_info``), else ``qemu-img info``."""
    if (info := qcow2_info(path)) is not None:
        return info
    out = run([_qemu_img(), "info", "--output=json", "-U", path])
    info = json.loads(out)
    backing = info.get("full-backing-filename") or info.get("backing-filename")
    return ImageInfo(int(info["virtual-size"]), Path(backing) if backing else None,
                     info.get("backing-filename-format"))


def create_overlay(path: Path, backing: Path, backing_format: str, size: int) -> None:
    """A new empty qcow2 ``path`` over ``backing``, which need not exist yet (its name is
    recorded, not opened: the snapshot that will hold it is still being written).

    Made without a process (a running snapshot makes one before each freeze, and spawning
    ``qemu-img`` costs ~20 ms): ``qemu-img create`` writes an empty overlay of one size and
    backing format once (``_overlay_template``), and every overlay is that file's bytes with
    the backing name put in; the result is byte for byte what ``qemu-img create`` writes
    for the real name (tests/storage/test_qcow2_overlay)."""
    name = os.fsencode(str(backing))
    template, offset, old_length = _overlay_template(size, backing_format)
    if offset + len(name) > _CLUSTER_0:  # the name must fit in the header's cluster
        run([_qemu_img(), "create", "-q", "-f", "qcow2", "-u", "-b", backing,
             "-F", backing_format, path, str(size)])
        return
    data = bytearray(template)
    struct.pack_into(">I", data, 16, len(name))
    data[offset:offset + old_length] = bytes(old_length)
    data[offset:offset + len(name)] = name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


_CLUSTER_0 = 1 << 16  # qemu-img's default cluster size; the header and backing name live here
_OVERLAY_TEMPLATES: dict[tuple[int, str], tuple[bytes, int, int]] = {}


def _overlay_template(size: int, backing_format: str) -> tuple[bytes, int, int]:
    """An empty qcow2 overlay of ``size`` over a placeholder backing name, as ``qemu-img``
    writes it (cached per process), with the offset and length of that name."""
    key = (size, backing_format)
    if key not in _OVERLAY_TEMPLATES:
        with tempfile.TemporaryDirectory(prefix="aenv-overlay-") as tmp:
            path = Path(tmp) / "template.qcow2"
            run([_qemu_img(), "create", "-q", "-f", "qcow2", "-u", "-b", "/placeholder",
                 "-F", backing_format, path, str(size)])
            data = path.read_bytes()
        offset, length = struct.unpack_from(">QI", data, 8)
        if data[:4] != _QCOW2_MAGIC or data[offset:offset + length] != b"/placeholder":
            raise SnapshotFilesError("qemu-img wrote an overlay this code does not know")
        _OVERLAY_TEMPLATES[key] = (data, offset, length)
    return _OVERLAY_TEMPLATES[key]


def flatten_onto(path: Path, root: Path | None, root_format: str | None) -> None:
    """Make qcow2 ``path`` self-contained above ``root``: every cluster its backing chain
    holds above ``root`` is copied into it and its backing becomes ``root`` (qemu-img's
    safe rebase reads only clusters allocated between the two, so this costs the data
    written in the chain, not the disk size). ``root`` None copies everything."""
    if root is None:
        run([_qemu_img(), "rebase", "-q", "-f", "qcow2", "-b", "", path])
    else:
        run([_qemu_img(), "rebase", "-q", "-f", "qcow2", "-b", root, "-F", root_format or "raw",
             path])
