"""Writes that survive a power loss, not only the server process.

A rename makes a file appear atomically, but without fsync the kernel may write the new
directory entry before the file's data: after a crash of the host the name exists and the
content is zeros. The rule used everywhere state is kept (snapshots, layers, keys): fsync
the data, rename into place, fsync the directory that holds the new name. Cost: what the
page cache still holds dirty for those files, written once; nothing is re-read.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


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
    (snapshot directories are flat; symlinks are not followed)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode):
                fsync_file(Path(entry.path))
    fsync_dir(directory)


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
