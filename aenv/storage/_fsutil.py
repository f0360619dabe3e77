"""Small filesystem helpers shared by the kernel and image builders.

``build_lock`` serialises builds of one kind between processes; ``staging`` gives a scratch
directory next to the final path that is renamed into place only when complete, so a crash
mid-build never leaves something that looks finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A fresh directory beside ``final``; on success it is renamed to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tree_size(root: Path) -> int:
    """Bytes allocated by the files below ``root`` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


@contextlib.contextmanager
def scratch(parent: Path, prefix: str = "tmp-") -> Iterator[Path]:
    """A scratch directory under ``parent`` (created as root, mode 0755), always removed."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
