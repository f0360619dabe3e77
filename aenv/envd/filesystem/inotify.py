"""Linux inotify through ctypes: one non-blocking descriptor, watches, and raw events.

Contract: ``Inotify`` owns one inotify descriptor opened with ``IN_NONBLOCK | IN_CLOEXEC``.
``read()`` returns every event the kernel has queued *at the moment of the call* and never
blocks, which is what lets GetWatcherEvents answer with everything a write that already
returned has produced. Callers poll the descriptor themselves (``fileno()`` with
``loop.add_reader``); this module knows nothing about asyncio or watch trees.

Why ctypes and not a PyPI package: the kernel interface is three libc calls and a fixed
16-byte record, about forty lines. ``inotify_simple`` (the best-kept small wrapper) wraps
exactly that and nothing we would reuse (we keep our own watch tree, drain loop and event
translation), so depending on it would add a package to envd's minimal guest set for no
behaviour we don't write anyway.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from dataclasses import dataclass

# <sys/inotify.h>
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
# Room for many records per read(2); a record is 16 bytes plus a padded name.
_READ_SIZE = 256 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


@dataclass(frozen=True, slots=True)
class RawEvent:
    wd: int
    mask: int
    cookie: int
    name: str  # entry name inside the watched directory; "" for the directory itself


def _raise_errno(what: str, path: str | None = None) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}", path)


class Inotify:
    def __init__(self) -> None:
        fd: int = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            _raise_errno("inotify_init1")
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def add_watch(self, path: str, mask: int) -> int:
        """Watch ``path`` (symlinks followed); re-adding a watched inode returns its wd."""
        wd: int = _libc.inotify_add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            _raise_errno("inotify_add_watch", path)
        return wd

    def rm_watch(self, wd: int) -> None:
        """Stop watching ``wd``; a wd the kernel already dropped is not an error."""
        if _libc.inotify_rm_watch(self._fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
            _raise_errno("inotify_rm_watch")

    def read(self) -> list[RawEvent]:
        """Every event queued now, oldest first; empty when nothing is pending."""
        events: list[RawEvent] = []
        while True:
            try:
                buf = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return events
            offset = 0
            while offset + _HEADER.size <= len(buf):
                wd, mask, cookie, length = _HEADER.unpack_from(buf, offset)
                start = offset + _HEADER.size
                raw_name = buf[start : start + length].rstrip(b"\0")
                events.append(RawEvent(wd, mask, cookie, os.fsdecode(raw_name)))
                offset = start + length

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
