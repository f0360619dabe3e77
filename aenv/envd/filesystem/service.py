"""The ``filesystem.Filesystem`` Connect service (mounted by ``rpc.ConnectService``).

Every call acts for one user: the one named by HTTP Basic auth, else the default user from
``/init``; an unknown name is ``unauthenticated``. The user decides what relative paths
and ``~`` mean (their home) and who owns the directories envd creates.

Permissions: envd runs as root and, like upstream envd 0.6.13, performs every operation
with root's rights; it checks no per-user access. A caller naming ``user`` can therefore
read or remove root's files, exactly as against E2B. What the kernel still refuses to
root (read-only mounts, immutable files) is ``permission_denied``.

Errors: not found -> ``not_found``; wrong kind of path -> ``invalid_argument``; existing
directory on MakeDir -> ``already_exists``; symlink loop -> ``failed_precondition``;
anything else -> ``internal``. Watchers are kept per process and live until removed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import stat
import string
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from ..proto import filesystem_pb as pb
from ..state import EnvdState
from ..users import UnknownUser, User, basic_auth_user, resolve_path
from . import mounts
from .dirs import ensure_dirs
from .entry import entry_info
from .errors import (
    AlreadyExists,
    FilesystemError,
    InvalidPath,
    NotFound,
    PermissionDenied,
    SymlinkLoop,
    from_os_error,
)
from .listing import list_dir
from .watcher import DirWatcher

DEFAULT_KEEPALIVE_S = 90.0
_CODES: dict[type[FilesystemError], Code] = {
    NotFound: Code.NOT_FOUND,
    AlreadyExists: Code.ALREADY_EXISTS,
    InvalidPath: Code.INVALID_ARGUMENT,
    SymlinkLoop: Code.FAILED_PRECONDITION,
    PermissionDenied: Code.PERMISSION_DENIED,
}
_ID_ALPHABET = string.ascii_lowercase + string.digits
# A call's context: its headers and deadline are all this service reads of it.
Ctx = RequestContext[Any, Any]


@contextmanager
def _as_connect() -> Iterator[None]:
    """Raise FilesystemErrors as the ConnectError the wire contract names."""
    try:
        yield
    except FilesystemError as e:
        raise ConnectError(_CODES.get(type(e), Code.INTERNAL), e.message) from None


def request_user(state: EnvdState, ctx: Ctx) -> User:
    """The Basic-auth user of the call, else the default user. ``unauthenticated`` if unknown."""
    name = basic_auth_user(ctx.request_headers.get("authorization"))
    try:
        if name is not None:
            return User.lookup(name)
        try:
            return User.lookup(state.default_user)
        except UnknownUser:
            raise ConnectError(
                Code.UNAUTHENTICATED, f"invalid default user: '{state.default_user}'"
            ) from None
    except UnknownUser as e:
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from None


def stat_entry(path: str) -> pb.EntryInfo:
    try:
        return entry_info(path)
    except OSError as e:
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise NotFound(f"file not found: {path}") from None
        raise from_os_error(e, "error getting file info") from None


def remove_all(path: str) -> None:
    """``rm -rf path``: a missing path, or one that vanishes meanwhile, is success."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        raise from_os_error(e, "error removing file or directory") from None
    try:
        if not is_dir:
            os.unlink(path)
        elif sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_ignore_vanished)
        else:
            shutil.rmtree(path, onerror=lambda f, p, exc: _ignore_vanished(f, p, exc[1]))
    except FileNotFoundError:
        return
    except OSError as e:
        raise from_os_error(e, "error removing file or directory") from None


def _ignore_vanished(_func: object, _path: str, exc: BaseException) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc


def keepalive_interval(ctx: Ctx) -> float:
    """Seconds between keepalives: the ``Keepalive-Ping-Interval`` header, else 90."""
    try:
        value = float(int(ctx.request_headers.get("keepalive-ping-interval", "")))
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return value if value > 0 else DEFAULT_KEEPALIVE_S


def _new_watcher_id() -> str:
    return "w" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


class FilesystemService:
    def __init__(self, state: EnvdState) -> None:
        self.state = state
        self._watchers: dict[str, DirWatcher] = {}

    def _resolve(self, ctx: Ctx, path: str) -> tuple[User, str]:
        user = request_user(self.state, ctx)
        return user, resolve_path(path, user, self.state.default_workdir)

    async def stat(self, request: pb.StatRequest, ctx: Ctx) -> pb.StatResponse:
        _, path = self._resolve(ctx, request.path)
        with _as_connect():
            return pb.StatResponse(entry=stat_entry(path))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: Ctx) -> pb.MakeDirResponse:
        user, path = self._resolve(ctx, request.path)
        with _as_connect():
            try:
                is_dir = stat.S_ISDIR(os.stat(path).st_mode)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise from_os_error(e, "error getting file info") from None
            else:
                if is_dir:
                    raise AlreadyExists(f"directory already exists: {path}")
                raise InvalidPath(f"path already exists but it is not a directory: {path}")
            ensure_dirs(path, user.uid, user.gid)
            return pb.MakeDirResponse(entry=stat_entry(path))

    async def move(self, request: pb.MoveRequest, ctx: Ctx) -> pb.MoveResponse:
        user, source = self._resolve(ctx, request.source)
        destination = resolve_path(request.destination, user, self.state.default_workdir)
        with _as_connect():
            ensure_dirs(os.path.dirname(destination), user.uid, user.gid)
            try:
                os.rename(source, destination)
            except FileNotFoundError:
                raise NotFound(f"source file not found: {source}") from None
            except OSError as e:
                raise from_os_error(e, "error renaming") from None
            return pb.MoveResponse(entry=stat_entry(destination))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Ctx) -> pb.ListDirResponse:
        _, path = self._resolve(ctx, request.path)
        with _as_connect():
            entries = await asyncio.to_thread(list_dir, path, request.depth)
        return pb.ListDirResponse(entries=entries)

    async def remove(self, request: pb.RemoveRequest, ctx: Ctx) -> pb.RemoveResponse:
        _, path = self._resolve(ctx, request.path)
        with _as_connect():
            await asyncio.to_thread(remove_all, path)
        return pb.RemoveResponse()

    # -- watching ---------------------------------------------------------------------

    async def _open_watcher(
        self, ctx: Ctx, req: pb.WatchDirRequest | pb.CreateWatcherRequest
    ) -> DirWatcher:
        _, path = self._resolve(ctx, req.path)
        with _as_connect():
            try:
                is_dir = stat.S_ISDIR(os.stat(path).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                raise NotFound(f"path {path} not found") from None
            except OSError as e:
                raise from_os_error(e, f"error statting path {path}") from None
            if not is_dir:
                raise InvalidPath(f"path {path} not a directory")
            if not req.allow_network_mounts:
                try:
                    on_network = mounts.is_network_mount(path)
                except OSError as e:
                    raise FilesystemError(f"error checking mount status: {e.strerror}") from None
                if on_network:
                    raise InvalidPath(f"cannot watch path on network filesystem: {path}")
            watcher = await asyncio.to_thread(
                DirWatcher.open, path, req.recursive, req.include_entry
            )
        watcher.attach(asyncio.get_running_loop())
        return watcher

    async def watch_dir(
        self, request: pb.WatchDirRequest, ctx: Ctx
    ) -> AsyncIterator[pb.WatchDirResponse]:
        remaining_ms = ctx.timeout_ms
        deadline = None if remaining_ms is None else time.monotonic() + remaining_ms / 1000
        interval = keepalive_interval(ctx)
        watcher = await self._open_watcher(ctx, request)
        try:
            start: Oneof[Literal["start"], pb.WatchDirResponse.StartEvent] = Oneof(
                "start", pb.WatchDirResponse.StartEvent())
            yield pb.WatchDirResponse(event=start)
            while True:
                wait = interval
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ConnectError(Code.DEADLINE_EXCEEDED, "watch deadline exceeded")
                    wait = min(wait, left)
                with _as_connect():
                    events = await watcher.wait(wait)
                for event in events:
                    change: Oneof[Literal["filesystem"], pb.FilesystemEvent] = Oneof(
                        "filesystem", event)
                    yield pb.WatchDirResponse(event=change)
                if not events and (deadline is None or time.monotonic() < deadline):
                    keepalive: Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive] = \
                        Oneof("keepalive", pb.WatchDirResponse.KeepAlive())
                    yield pb.WatchDirResponse(event=keepalive)
        finally:
            watcher.close()

    async def create_watcher(
        self, request: pb.CreateWatcherRequest, ctx: Ctx
    ) -> pb.CreateWatcherResponse:
        watcher = await self._open_watcher(ctx, request)
        watcher_id = _new_watcher_id()
        self._watchers[watcher_id] = watcher
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    async def get_watcher_events(
        self, request: pb.GetWatcherEventsRequest, ctx: Ctx
    ) -> pb.GetWatcherEventsResponse:
        watcher = self._watcher(request.watcher_id)
        watcher.drain()
        with _as_connect():
            return pb.GetWatcherEventsResponse(events=watcher.take())

    async def remove_watcher(
        self, request: pb.RemoveWatcherRequest, ctx: Ctx
    ) -> pb.RemoveWatcherResponse:
        watcher = self._watcher(request.watcher_id)
        del self._watchers[request.watcher_id]
        watcher.close()
        return pb.RemoveWatcherResponse()

    def _watcher(self, watcher_id: str) -> DirWatcher:
        watcher = self._watchers.get(watcher_id)
        if watcher is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id {watcher_id} not found")
        return watcher

