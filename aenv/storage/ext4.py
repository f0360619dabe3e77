"""Make an ext4 image file from a directory tree with ``mkfs.ext4 -d`` (no mount, no loop).

Ownership, modes, times, device nodes, hard links and xattrs come from the tree, so the tree
must have been built as root. The file is sparse: only what the tree holds plus ext4's
metadata is allocated. Inode tables and the journal are initialised at build time, so the
guest kernel never starts lazy zeroing in the background (that would write through every
sandbox's copy-on-write disk and cost CPU under emulation).

Default size: ``DEFAULT_SIZE`` (4 GiB) or, for bigger trees, the tree plus a quarter plus
``MIN_FREE``, rounded up to 64 MiB — what a sandbox can write before its disk is full.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ._fsutil import tree_size
from ._run import run
from .errors import ImageError

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_SIZE = 4 * GiB
MIN_FREE = 1 * GiB
LABEL = "aenv-root"


def default_size(tree: Path) -> int:
    used = tree_size(tree)
    want = max(DEFAULT_SIZE, used + used // 4 + MIN_FREE)
    return -(-want // (64 * MiB)) * (64 * MiB)


def make_ext4(tree: Path, out: Path, *, size_bytes: int | None = None, seed: str = "") -> int:
    """Write the ext4 image of ``tree`` to ``out``; returns its size in bytes.

    ``seed`` (e.g. the image digest) fixes the filesystem UUID and directory hash seed, so
    the same inputs give the same filesystem identity.
    """
    size = size_bytes or default_size(tree)
    if size < 16 * MiB:
        raise ImageError(f"image size {size} is too small for ext4")
    fs_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"aenv:{seed}")) if seed else str(uuid.uuid4())
    out.unlink(missing_ok=True)
    with open(out, "wb") as f:
        f.truncate(size)
    run([
        "mkfs.ext4", "-q", "-F",
        "-L", LABEL,
        "-U", fs_uuid,
        "-m", "1",
        "-E", f"lazy_itable_init=0,lazy_journal_init=0,hash_seed={fs_uuid}",
        "-d", tree,
        out,
    ])
    return size
