"""Write one uploaded file to disk for a user, streaming (upstream envd's ``processFile``).

Steps: create missing parents (0755, chown'ed, see ``ensure_dirs``); refuse a directory
(400); chown an existing target first, else create it ``O_WRONLY|O_CREAT|O_TRUNC`` 0666
(0644 under umask 022) and fchown it; write the body; then replace the file's metadata
xattrs (an upload without metadata clears them). For a new small file that is exactly
create, chmod and write for inotify watchers, in that order.

Memory is bounded whatever the size: the body is written as it arrives, through one
write-behind buffer (``_WriteBehind``) so disk writes (in a worker thread, which releases
the GIL) overlap with receiving the next bytes. No temporary copy is made.

Failure: ENOSPC/EDQUOT is 507; a body that breaks off or fails to decode removes the file
if this upload created it, so a rejected new file does not appear.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections.abc import AsyncIterator

from ..filesystem import metadata as xattrs
from ..filesystem.dirs import ensure_dirs
from ..filesystem.entry import base_name
from ..filesystem.errors import (
    FilesystemError,
    InvalidPath,
    NoSpace,
    PermissionDenied,
    from_os_error,
)
from ..users import User
from .errors import FilesHTTPError

# Disk writes are batched to this size and handed to a worker thread; one batch may be in
# flight while the next fills, so at most ~2 batches plus one received chunk are held.
WRITE_BATCH = 1 << 20
# A body that ends below this size with nothing in flight is written on the loop thread:
# for small files the thread hop would cost more than the copy into the page cache.
INLINE_TAIL = 256 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class _WriteBehind:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._inflight: asyncio.Future[None] | None = None
        self.written = 0

    async def write(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= WRITE_BATCH:
            await self._flush()

    async def _flush(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            await inflight
        if self._buf:
            batch, self._buf = self._buf, bytearray()
            self._inflight = asyncio.get_running_loop().run_in_executor(
                None, _write_all, self._fd, batch
            )
            self.written += len(batch)

    async def close(self) -> None:
        """Write what is left and wait for it. A small tail is written inline (no hop)."""
        if self._inflight is None and len(self._buf) < INLINE_TAIL:
            batch, self._buf = self._buf, bytearray()
            _write_all(self._fd, batch)
            self.written += len(batch)
            return
        await self._flush()
        await self.settle()

    async def settle(self) -> None:
        """Wait for the write in flight (its fd must stay open until it returns)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            await inflight


def _write_all(fd: int, data: bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _status_of(err: FilesystemError) -> int:
    if isinstance(err, InvalidPath):
        return 400
    if isinstance(err, PermissionDenied):
        return 403
    if isinstance(err, NoSpace):
        return 507
    return 500


def _open_target(path: str, user: User) -> tuple[int, bool]:
    """Open ``path`` for writing, truncated, owned by ``user``; returns (fd, existed)."""
    existed = False
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            raise FilesHTTPError(400, f"path is a directory: {path}")
        existed = True
        os.chown(path, user.uid, user.gid)
    except FileNotFoundError:
        pass
    except OSError as e:
        err = from_os_error(e, "error getting file info")
        raise FilesHTTPError(_status_of(err), err.message) from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise FilesHTTPError(507, f"not enough inodes available: {e}") from None
        err = from_os_error(e, "error opening file")
        raise FilesHTTPError(_status_of(err), err.message) from None
    return fd, existed


async def write_file(
    path: str, body: AsyncIterator[bytes], user: User, metadata: dict[str, str]
) -> dict[str, object]:
    """Store ``body`` at ``path`` (absolute); returns the upload's JSON entry."""
    try:
        ensure_dirs(os.path.dirname(path), user.uid, user.gid)
    except FilesystemError as e:
        raise FilesHTTPError(_status_of(e), f"error ensuring directories: {e.message}") from None

    fd, existed = _open_target(path, user)
    writer = _WriteBehind(fd)
    done = False
    try:
        if not existed:
            os.fchown(fd, user.uid, user.gid)
        async for chunk in body:
            await writer.write(chunk)
        await writer.close()
        try:
            xattrs.replace(fd, metadata)
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise FilesHTTPError(507, f"not enough space for file metadata: {e}") from None
            if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise FilesHTTPError(500, f"error writing file metadata: {e}") from None
        done = True
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise FilesHTTPError(
                507, f"attempted to write {writer.written} bytes: not enough disk space available"
            ) from None
        raise FilesHTTPError(500, f"error writing file: {e}") from None
    finally:
        with contextlib.suppress(OSError):
            await writer.settle()
        os.close(fd)
        if not done and not existed:
            with contextlib.suppress(OSError):
                os.unlink(path)

    entry: dict[str, object] = {"path": path, "name": base_name(path), "type": "file"}
    try:
        persisted = xattrs.read(path)
    except OSError:
        persisted = {}
    if persisted:
        entry["metadata"] = persisted
    return entry
