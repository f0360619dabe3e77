"""Writes that survive a power loss, not only the server process.

A rename makes a file appear atomically, but without fsync the kernel may write the new
directory entry before the file's data: after a crash of the host the name exists and the
content is zeros. The rule used everywhere state is kept (snapshots, layers, keys): fsync
the data, rename into place, fsync the directory that holds the new name. Cost: what the
page cache still holds dirty for those files, written once; nothing is re-read.
"""

from __future__ import annotations

import ctypes
import os
import stat
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes of ``fd`` at ``offset`` to the
    device now, without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): a
    writer that calls it as it goes overlaps the device's writes with its own work, so its
    final fsync waits for little. The pages stay cached. A no-op where the call is missing.
    Durability still needs the fsync."""
    if _sync_file_range is None:
        return
    _sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length),
                     _SYNC_FILE_RANGE_WRITE)


def _libc_sync_file_range() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    call: Callable[..., int] = fn
    return call


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = _libc_sync_file_range()


def fsync_file(path: Path) -> None:
    """Flush one file's data and metadata to the device (the file itself, not a link)."""
    _fsync(path, os.O_NOFOLLOW)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it)."""
    _fsync(path, os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every regular file directly in ``directory``, then the directory itself
    (snapshot directories are flat; symlinks are not followed). The files are flushed at
    once, from a few threads: the filesystem's journal then commits them together instead
    of once per file (ext4: ~30 -> ~20 ms for a running snapshot's five files)."""
    with os.scandir(directory) as entries:
        files = [Path(e.path) for e in entries
                 if stat.S_ISREG(e.stat(follow_symlinks=False).st_mode)]
    if len(files) > 1:
        with ThreadPoolExecutor(min(len(files), _FSYNC_THREADS),
                                thread_name_prefix="aenv-fsync") as pool:
            for _ in pool.map(fsync_file, files):  # re-raises the first error
                pass
    elif files:
        fsync_file(files[0])
    fsync_dir(directory)


_FSYNC_THREADS = 8


def rename_durably(src: Path, dst: Path) -> None:
    """``os.rename`` whose result survives a crash (both parents flushed)."""
    os.rename(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data``: a reader (or a crash) sees the old file or the whole
    new one, never a short or empty one. The temp name is unique, so concurrent writers
    do not share it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
