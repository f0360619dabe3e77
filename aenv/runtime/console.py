"""The guest serial console log (``console.log``), kept to a bounded size.

Root inside a sandbox can write to the serial port as fast as the VMM emulates it, and the
VMM appends all of it to ``console.log`` on the host's disk: left alone, one sandbox could
fill the disk every other sandbox lives on. ``bound`` cuts the head off a log that grew past
``MAX_BYTES`` and keeps the newest ``KEEP_BYTES`` while the VMM goes on writing:

- where the filesystem can (ext4, XFS), ``fallocate(FALLOC_FL_COLLAPSE_RANGE)`` removes the
  leading blocks in place, atomically with respect to the writer: nothing newer is lost;
- elsewhere (tmpfs, btrfs) the tail is read, the file truncated and the tail appended again;
  lines the guest writes in between may be lost.

Either way the VMM's next write lands at the new end only if it opened the log with
``O_APPEND`` (QEMU: ``-chardev file,append=on``); a writer without it leaves a hole in front
of its next line, which costs no disk space.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

MAX_BYTES = 4 << 20
KEEP_BYTES = 1 << 20
_FALLOC_FL_COLLAPSE_RANGE = 0x08  # <linux/falloc.h>

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def bound(path: Path, max_bytes: int = MAX_BYTES, keep_bytes: int = KEEP_BYTES) -> int:
    """Cut ``path`` to about its last ``keep_bytes`` once it is longer than ``max_bytes``.
    Returns the number of bytes removed (0 when it was within the limit or is missing)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        st = os.fstat(fd)
        if st.st_size <= max_bytes:
            return 0
        block = st.st_blksize or 4096
        cut = (st.st_size - keep_bytes) // block * block  # collapse takes whole blocks
        if cut <= 0:
            return 0
        if _libc.fallocate(fd, _FALLOC_FL_COLLAPSE_RANGE, 0, cut) == 0:
            return cut
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(err, os.strerror(err), str(path))
        tail = os.pread(fd, keep_bytes, st.st_size - keep_bytes)
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    with open(path, "ab") as f:  # after whatever the VMM appended since the truncate
        f.write(tail)
    return st.st_size - len(tail)
