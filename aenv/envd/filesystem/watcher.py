"""Watch a directory (optionally its whole tree) and turn inotify records into events.

Contract:
* A ``DirWatcher`` is built off the event loop (``open`` may walk a large tree), then
  ``attach``-ed to the loop; from then on every method runs on the loop thread.
* ``drain()`` reads everything the kernel has queued, synchronously. GetWatcherEvents
  calls it before answering, so the events of a write that already returned are there.
  The loop also drains on readability, so the kernel queue never overflows while nobody
  polls.
* Translation follows fsnotify (what upstream envd uses): one record may give several
  events, in the order CREATE, RENAME, CHMOD, WRITE, REMOVE; ``name`` is relative to the
  watched directory. In a recursive watch every directory that appears (created or moved
  in) is watched with its whole subtree at once, and a directory moved away stops being
  watched. A root that is moved away reports RENAME (recursive) and is no longer watched.
* Events queue in memory until taken. Past ``MAX_PENDING`` unread events, or on a kernel
  queue overflow, the watcher fails for good and ``error`` says why, as upstream does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from dataclasses import dataclass

from ..proto import filesystem_pb as pb
from . import inotify
from .entry import entry_info
from .errors import FilesystemError, from_os_error

MASK = (
    inotify.IN_CREATE
    | inotify.IN_MODIFY
    | inotify.IN_DELETE
    | inotify.IN_DELETE_SELF
    | inotify.IN_MOVED_TO
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVE_SELF
    | inotify.IN_ATTRIB
)
MAX_PENDING = 100_000
_E = pb.EventType
# (mask bits, event type) in the order one record's events are emitted.
_OPS = (
    (inotify.IN_CREATE | inotify.IN_MOVED_TO, _E.CREATE),
    (inotify.IN_MOVE_SELF | inotify.IN_MOVED_FROM, _E.RENAME),
    (inotify.IN_ATTRIB, _E.CHMOD),
    (inotify.IN_MODIFY, _E.WRITE),
    (inotify.IN_DELETE | inotify.IN_DELETE_SELF, _E.REMOVE),
)
_CARRIES_ENTRY = frozenset({_E.CREATE, _E.WRITE, _E.CHMOD})
# A subdirectory that vanished or changed before we could watch it is simply not watched.
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.EACCES)

_live: set[DirWatcher] = set()


def drain_live_watchers() -> None:
    """Let every attached watcher read its queue now.

    envd calls this right after it creates a directory itself, so a recursive watcher
    already watches the new directory when the same request creates files inside it.
    Must run on the event loop thread.
    """
    for watcher in list(_live):
        watcher.drain()


@dataclass(slots=True)
class _Watch:
    wd: int
    path: str
    is_root: bool


class DirWatcher:
    def __init__(self, root: str, recursive: bool, include_entry: bool) -> None:
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.error: FilesystemError | None = None
        self._ino: inotify.Inotify | None = inotify.Inotify()
        self._by_wd: dict[int, _Watch] = {}
        self._by_path: dict[str, int] = {}
        self._pending: list[pb.FilesystemEvent] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = asyncio.Event()

    @classmethod
    def open(cls, root: str, recursive: bool, include_entry: bool) -> DirWatcher:
        """Watch ``root`` (an existing directory). Blocking: run it in a worker thread."""
        try:
            watcher = cls(root, recursive, include_entry)
        except OSError as e:  # EMFILE: the per-user limit of inotify instances (128)
            raise from_os_error(e, "error creating watcher") from None
        try:
            watcher._add(root, is_root=True)
            if recursive:
                watcher._add_subtree(root)
        except OSError as e:
            watcher.close()
            raise from_os_error(e, f"error adding path {root} to watcher") from None
        return watcher

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._ino is not None
        self._loop = loop
        loop.add_reader(self._ino.fileno(), self.drain)
        _live.add(self)

    def close(self) -> None:
        _live.discard(self)
        if self._ino is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._ino.fileno())
            self._ino.close()
            self._ino = None
        self._wakeup.set()

    # -- reading ----------------------------------------------------------------------

    def drain(self) -> None:
        if self._ino is None:
            return
        try:
            records = self._ino.read()
        except OSError as e:
            self._fail(f"reading inotify: {e.strerror}")
            return
        for record in records:
            self._translate(record)
            if self._ino is None:  # failed while translating
                return
        if self._pending:
            self._wakeup.set()

    def take(self) -> list[pb.FilesystemEvent]:
        """Events since the last take, oldest first. Raises the watcher's error, if any."""
        if self.error is not None:
            raise self.error
        events, self._pending = self._pending, []
        self._wakeup.clear()
        return events

    async def wait(self, timeout: float | None) -> list[pb.FilesystemEvent]:
        """Events as soon as there are any, or ``[]`` after ``timeout`` seconds."""
        if not self._pending and self.error is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
        return self.take()

    # -- watch tree -------------------------------------------------------------------

    def _add(self, path: str, is_root: bool = False) -> None:
        assert self._ino is not None
        wd = self._ino.add_watch(path, MASK)
        known = self._by_wd.get(wd)
        if known is not None:  # the same directory under a new name (moved in the tree)
            self._by_path.pop(known.path, None)
            known.path = path
        else:
            self._by_wd[wd] = _Watch(wd, path, is_root)
        self._by_path[path] = wd

    def _add_subtree(self, top: str) -> None:
        """Watch every directory below ``top`` (not following symlinks)."""
        stack = [top]
        while stack:
            current = stack.pop()
            try:
                with os.scandir(current) as it:
                    dirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
            except OSError as e:
                if e.errno in _GONE:
                    continue
                raise
            for path in dirs:
                try:
                    self._add(path)
                except OSError as e:
                    if e.errno in _GONE:
                        continue
                    raise
                stack.append(path)

    def _forget(self, watch: _Watch) -> None:
        self._by_wd.pop(watch.wd, None)
        if self._by_path.get(watch.path) == watch.wd:
            del self._by_path[watch.path]

    def _unwatch_subtree(self, top: str) -> None:
        """Stop watching ``top`` and everything below it (it left the tree)."""
        assert self._ino is not None
        prefix = top + "/"
        gone = [w for w in self._by_wd.values() if w.path == top or w.path.startswith(prefix)]
        for watch in gone:
            self._forget(watch)
            self._ino.rm_watch(watch.wd)

    # -- translation ------------------------------------------------------------------

    def _translate(self, record: inotify.RawEvent) -> None:
        mask = record.mask
        if mask & inotify.IN_Q_OVERFLOW:
            self._fail("fsnotify: queue or buffer overflow")
            return
        watch = self._by_wd.get(record.wd)
        if watch is None:
            return
        path = os.path.join(watch.path, record.name) if record.name else watch.path

        if mask & (inotify.IN_IGNORED | inotify.IN_UNMOUNT):
            self._forget(watch)
            return
        if mask & inotify.IN_DELETE_SELF:
            self._forget(watch)
            if os.path.dirname(watch.path) in self._by_path:
                return  # the parent's watch reports this removal
        if mask & inotify.IN_MOVE_SELF:
            if not watch.is_root:
                return  # the parent's watch reports the move
            self._unwatch_subtree(watch.path)
            if self.recursive:
                self._emit(path, _E.RENAME)
                return

        ops = [op for bits, op in _OPS if mask & bits]
        if self.recursive and mask & inotify.IN_ISDIR:
            if mask & inotify.IN_MOVED_FROM:
                self._unwatch_subtree(path)
            if mask & (inotify.IN_CREATE | inotify.IN_MOVED_TO):
                try:
                    self._add(path)
                    self._add_subtree(path)
                except OSError as e:
                    if e.errno not in _GONE:
                        self._fail(f"adding {path}: {e.strerror}")
                        return
        for op in ops:
            self._emit(path, op)

    def _emit(self, path: str, op: pb.EventType) -> None:
        entry = None
        if self.include_entry and op in _CARRIES_ENTRY:
            try:
                entry = entry_info(path)
            except OSError:
                entry = None
        self._pending.append(
            pb.FilesystemEvent(name=os.path.relpath(path, self.root), type=op, entry=entry)
        )
        if len(self._pending) > MAX_PENDING:
            self._fail(f"more than {MAX_PENDING} events were not collected")

    def _fail(self, reason: str) -> None:
        self.error = FilesystemError(f"watcher error: {reason}")
        self._pending = []
        self.close()
