"""Per-sandbox writable disks: a copy-on-write view of a shared read-only base image.

``create_disk(base, directory)`` never copies data. Where the filesystem holding both files can
share extents, the disk is a reflink of ``base`` made with the FICLONE ioctl (the kernel does
the copy-on-write, the guest sees a raw file, ~0.1 ms). Elsewhere the disk is a qcow2 overlay
whose backing file is ``base`` (``qemu-img create -f qcow2 -b base -F raw``, ~20 ms): QEMU
does the copy-on-write. Which one a directory gets is probed once per pair of filesystems
(st_dev) with two scratch files, and cached; ``doctor_checks`` reports it for the data dir.

The base must stay unchanged while any disk made from it exists: overlays read it directly,
and the images store treats it as immutable.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ._run import run
from .errors import StorageError

FICLONE = 0x40049409  # _IOW(0x94, 9, int)

Method = Literal["reflink", "qcow2"]
# errnos by which FICLONE says "this filesystem (pair) cannot share extents"
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}


class DiskError(StorageError):
    """A per-sandbox disk could not be made."""


@dataclass(frozen=True)
class Disk:
    """A sandbox's writable disk. ``format`` is what the VMM must open it as."""

    path: Path
    format: Literal["raw", "qcow2"]
    method: Method
    base: Path


def reflink(src: Path, dest: Path) -> None:
    """Make ``dest`` a reflink copy of ``src`` (FICLONE); raises OSError where unsupported."""
    with open(src, "rb") as s, open(dest, "xb") as d:
        try:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        except OSError:
            os.unlink(dest)
            raise


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


_probed: dict[tuple[int, int], Method] = {}


def _probe(src_dir: Path, dest_dir: Path) -> Method:
    with tempfile.TemporaryDirectory(dir=src_dir, prefix=".aenv-reflink-") as a, \
            tempfile.TemporaryDirectory(dir=dest_dir, prefix=".aenv-reflink-") as b:
        src, dest = Path(a) / "src", Path(b) / "dest"
        src.write_bytes(b"\0" * 4096)
        try:
            reflink(src, dest)
        except OSError as e:
            if e.errno in _NO_REFLINK:
                return "qcow2"
            raise
        return "reflink"


def probe_method(base_dir: Path, dest_dir: Path) -> Method:
    """How disks of files in ``base_dir`` are made in ``dest_dir`` (cached per filesystem)."""
    b, d = _existing(base_dir), _existing(dest_dir)
    key = (os.stat(b).st_dev, os.stat(d).st_dev)
    if key not in _probed:
        _probed[key] = _probe(b, d)
    return _probed[key]


def create_disk(base: Path, directory: Path, name: str = "rootfs", *,
                method: Method | None = None) -> Disk:
    """Make ``directory/<name>.raw`` (reflink) or ``directory/<name>.qcow2`` (overlay): a
    writable copy-on-write disk over the image ``base`` (raw, or a qcow2 layer).

    The suffix is the format the VMM must open it as, which is how a VM working directory
    names its drives. ``method`` forces one mechanism (tests); by default the probe for the
    two directories decides. The disk must not exist yet.
    """
    if not base.is_file():
        raise DiskError(f"base image {base} does not exist")
    directory.mkdir(parents=True, exist_ok=True)
    base_format = "qcow2" if base.suffix == ".qcow2" else "raw"
    # A qcow2 base (a committed template layer) can only be overlaid, not cloned raw.
    chosen = method or ("qcow2" if base_format == "qcow2"
                        else probe_method(base.parent, directory))
    dest = directory / f"{name}.{'raw' if chosen == 'reflink' else 'qcow2'}"
    if dest.exists():
        raise DiskError(f"{dest} already exists")
    if chosen == "reflink":
        try:
            reflink(base, dest)
        except OSError as e:
            raise DiskError(f"reflink {base} -> {dest}: {e.strerror}") from e
        return Disk(dest, "raw", "reflink", base)
    shutil.copyfile(_pristine_overlay(base, base_format, directory.parent), dest)
    return Disk(dest, "qcow2", "qcow2", base)


def _overlay_key(resolved: Path, base_format: str) -> str:
    """The cache name of an overlay of ``resolved``: it changes when the file is replaced."""
    st = resolved.stat()
    key = hashlib.sha256(f"{resolved}:{st.st_ino}:{st.st_mtime_ns}:{base_format}".encode())
    return key.hexdigest()[:32]


_overlay_locks: dict[Path, threading.Lock] = {}
_overlay_locks_guard = threading.Lock()


def _pristine_overlay(base: Path, base_format: str, cache_root: Path) -> Path:
    """An empty qcow2 overlay of ``base``, made once with ``qemu-img`` and then copied for
    each sandbox: every overlay of one base is byte-identical, and copying 200 KiB takes
    0.1 ms where spawning qemu-img takes 6-20 ms on the create path. Callers asking for
    the same overlay at once (a fork's children, all over its new capture) wait for the
    one that makes it instead of each running qemu-img."""
    resolved = base.resolve()
    cached = cache_root / OVERLAY_CACHE / f"{_overlay_key(resolved, base_format)}.qcow2"
    if cached.exists():
        return cached
    with _overlay_locks_guard:
        lock = _overlay_locks.setdefault(cached, threading.Lock())
    try:
        with lock:
            if cached.exists():
                return cached
            qemu_img = shutil.which("qemu-img")
            if qemu_img is None:
                raise DiskError("qemu-img is missing (apt-get install qemu-utils)")
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp-{os.getpid()}-{threading.get_ident()}")
            run([qemu_img, "create", "-q", "-f", "qcow2", "-b", resolved, "-F", base_format,
                 tmp])
            os.replace(tmp, cached)
            return cached
    finally:
        with _overlay_locks_guard:
            if not lock.locked():
                _overlay_locks.pop(cached, None)


OVERLAY_CACHE = ".overlays"
_QCOW2_MAGIC = b"QFI\xfb"


def qcow2_backing_file(path: Path) -> str | None:
    """The backing file a qcow2 header names (None: not a qcow2, or no backing file). The
    header's first 20 bytes give the name's offset and length (qcow2 spec, big-endian)."""
    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:4] != _QCOW2_MAGIC:
            return None
        offset, size = int.from_bytes(head[8:16], "big"), int.from_bytes(head[16:20], "big")
        if offset == 0 or size == 0 or size > 4096:
            return None
        f.seek(offset)
        return f.read(size).decode(errors="surrogateescape")


def prune_overlay_cache(cache_root: Path) -> list[Path]:
    """Remove the cached empty overlays (``_pristine_overlay``) whose base is gone or was
    replaced: garbage collection deleted the snapshot they were made for, so no disk will
    be made from them again. Returns what was removed. A cached overlay is only ever read
    (copied), so removing one while a create copies it is harmless: the copy holds the
    data, and a later create of a live base makes the overlay again."""
    removed: list[Path] = []
    try:
        entries = list((cache_root / OVERLAY_CACHE).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.suffix != ".qcow2":
            continue  # a ``.tmp-*`` of a create in progress
        try:
            base = qcow2_backing_file(entry)
            stale = base is None or entry.stem not in {
                _overlay_key(Path(base), fmt) for fmt in ("raw", "qcow2")}
        except FileNotFoundError:
            stale = True  # the base is gone (or the entry, removed by another prune)
        except OSError:
            continue  # unreadable: keep it; it costs 200 KiB
        if stale:
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def doctor_checks(data_dir: Path | None = None) -> list[tuple[str, str]]:
    """One row: which copy-on-write mechanism sandbox disks get under the data directory."""
    if data_dir is None:
        from aenv.config import Settings

        data_dir = Settings.from_env().home
    where = _existing(data_dir)
    try:
        method = probe_method(where, where)
    except OSError as e:
        return [("sandbox disks", f"cannot probe {where}: {e.strerror}")]
    fstype = _fstype(where)
    if method == "reflink":
        return [("sandbox disks", f"reflink (FICLONE) on {fstype} at {where}")]
    return [("sandbox disks", f"qcow2 overlay ({fstype} at {where} has no reflink)")]


def _fstype(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point)."""
    best, fstype = "", "unknown"
    real = str(path.resolve())
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, typ
    return fstype
