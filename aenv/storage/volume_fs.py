"""File operations inside one volume's root, for the volume content API, that cannot escape it.

Every operation walks the path one component at a time with ``openat`` and
``O_NOFOLLOW | O_DIRECTORY`` from a descriptor of the volume root, so neither ``..`` (taken
lexically, and refused above the root) nor a symbolic link made by a sandbox (even one
swapped in during the call) leads outside: a symlink met on the way is refused, and one at
the end is reported (``type: symlink``, ``target``) or removed, never opened. Writes go to a
temporary file in the target's directory that is linked into place, so a full volume or a
cut upload never leaves half a file, and "exists unless force" is decided by the kernel
(``link`` refuses an existing name) rather than by a racy check.

New entries belong to the volume root's owner unless told otherwise: the root is made for
uid/gid 1000, the user the E2B SDKs run commands as, so what one writes the other can change.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
VOLUME_OWNER = 1000  # uid and gid of the volume root (the sandbox user "user")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TMP_PREFIX = ".aenv-upload-"


class PathError(Exception):
    """A content-API failure with its HTTP status and E2B code string."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PathNotFound(PathError):
    status, code = 404, "not_found"


class PathConflict(PathError):
    status, code = 409, "conflict"


class VolumeFull(PathError):
    status, code = 507, "insufficient_storage"


FULL = "the volume is full (its size is its quota)"


def parts(path: str) -> list[str]:
    """The components of a volume path, ``..`` resolved lexically; above the root is an
    error. ``/``, ``""`` and ``.`` are the root (``[]``)."""
    if "\0" in path:
        raise PathError("path must not contain NUL")
    out: list[str] = []
    for p in path.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not out:
                raise PathError(f"path {path} leads outside the volume")
            out.pop()
            continue
        if len(p.encode()) > 255:
            raise PathError("a path component is longer than 255 bytes")
        out.append(p)
    return out


def display(components: list[str]) -> str:
    return "/" + "/".join(components)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def _type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def entry(components: list[str], st: os.stat_result, target: str | None = None
          ) -> dict[str, Any]:
    """``VolumeEntryStat`` of the entry at ``components`` with (l)stat ``st``."""
    out: dict[str, Any] = {
        "name": components[-1] if components else "",
        "type": _type(st.st_mode),
        "path": display(components),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "atime": _rfc3339(st.st_atime),
        "mtime": _rfc3339(st.st_mtime),
        "ctime": _rfc3339(st.st_ctime),
    }
    if target is not None:
        out["target"] = target
    return out


@dataclass
class Volume:
    """A volume's root, by path; every call opens it afresh (volumes are few and calls short).

    ``limit``: a size in bytes that uploads must keep the volume under, for a volume whose
    filesystem does not bound it (a shared volume without a hard quota,
    ``storage.shared_volumes``); None where the filesystem itself does (an image, an XFS
    project quota). The volume's blocks are counted once per upload, at its start."""

    root: str
    limit: int | None = None

    @contextmanager
    def _root(self) -> Iterator[int]:
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            raise PathError(f"volume is not available: {e.strerror}") from None
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def directory(self, components: list[str], *, create: bool = False,
                  mode: int = DEFAULT_DIR_MODE, owner: tuple[int, int] | None = None
                  ) -> Iterator[int]:
        """A descriptor of the directory at ``components`` (missing ones made when
        ``create``); a symlink or a non-directory on the way is refused."""
        with self._root() as root:
            fd = os.dup(root)
            try:
                for i, name in enumerate(components):
                    try:
                        nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        if not create:
                            raise PathNotFound(
                                f"Path {display(components[:i + 1])} not found") from None
                        try:
                            os.mkdir(name, mode, dir_fd=fd)
                            os.chown(name, *(owner or _owner(root)), dir_fd=fd,
                                     follow_symlinks=False)
                        except FileExistsError:
                            pass
                        except OSError as e:
                            raise _os_error(e, components[:i + 1]) from None
                        try:
                            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                        except OSError as e:
                            raise _walk_error(e, components[:i + 1]) from None
                    except OSError as e:
                        raise _walk_error(e, components[:i + 1]) from None
                    os.close(fd)
                    fd = nfd
                yield fd
            finally:
                os.close(fd)

    # -- the content API's calls -----------------------------------------------------------

    def info(self, components: list[str]) -> dict[str, Any]:
        if not components:
            with self._root() as root:
                return entry(components, os.stat(root))
        with self.directory(components[:-1]) as d:
            return _lstat_entry(d, components)

    def entries(self, components: list[str], depth: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        with self.directory(components) as d:
            _walk(d, components, depth, out)
        return out

    def make_dir(self, components: list[str], *, mode: int | None, uid: int | None,
                 gid: int | None, force: bool) -> dict[str, Any]:
        if not components:
            raise PathConflict("Path / exists")
        with self.directory(components[:-1], create=force) as d:
            name = components[-1]
            try:
                os.mkdir(name, DEFAULT_DIR_MODE, dir_fd=d)
            except FileExistsError:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if not (force and stat.S_ISDIR(st.st_mode)):
                    raise PathConflict(f"Path {display(components)} exists") from None
            except OSError as e:
                raise _os_error(e, components) from None
            else:
                _set_owner(d, name, uid, gid)
                os.chmod(name, mode if mode is not None else DEFAULT_DIR_MODE, dir_fd=d)
            return _lstat_entry(d, components)

    def update(self, components: list[str], *, mode: int | None, uid: int | None,
               gid: int | None) -> dict[str, Any]:
        if not components:
            raise PathError("the volume root's metadata cannot be changed")
        with self.directory(components[:-1]) as d:
            name = components[-1]
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                raise PathNotFound(f"Path {display(components)} not found") from None
            if uid is not None or gid is not None:
                os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid,
                         dir_fd=d, follow_symlinks=False)
            if mode is not None:
                if stat.S_ISLNK(st.st_mode):
                    raise PathError("the mode of a symbolic link cannot be changed")
                os.chmod(name, mode, dir_fd=d)  # not a symlink (checked above; no follow)
            return _lstat_entry(d, components)

    def remove(self, components: list[str]) -> None:
        if not components:
            raise PathError("the volume root cannot be removed")
        with self.directory(components[:-1]) as d:
            name = components[-1]
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    # rmtree with dir_fd walks by descriptors and never follows a symlink.
                    shutil.rmtree(name, dir_fd=d)
                else:
                    os.unlink(name, dir_fd=d)
            except FileNotFoundError:
                raise PathNotFound(f"Path {display(components)} not found") from None

    def open_read(self, components: list[str]) -> int:
        """A descriptor to read the regular file at ``components`` (the caller closes it)."""
        if not components:
            raise PathError("the volume root is a directory")
        with self.directory(components[:-1]) as d:
            try:
                fd = os.open(components[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                             | os.O_NONBLOCK, dir_fd=d)
            except OSError as e:
                raise _walk_error(e, components) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PathError(f"Path {display(components)} is not a file")
            return fd

    def begin_write(self, components: list[str]) -> Upload:
        """A temporary file in the target's directory (parents made as needed)."""
        if not components:
            raise PathError("the volume root is a directory")
        with self._root() as root:
            owner = _owner(root)
        with self.directory(components[:-1], create=True, owner=owner) as d:
            dfd = os.dup(d)
        room = None if self.limit is None else self.limit - tree_bytes(self.root)
        if room is not None and room <= 0:
            os.close(dfd)
            raise VolumeFull(FULL)
        tmp = _TMP_PREFIX + secrets.token_hex(8)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            os.close(dfd)
            raise _os_error(e, components) from None
        return Upload(components, dfd, tmp, fd, owner, room)


@dataclass
class Upload:
    """A write in progress: ``write`` chunks, then ``commit`` or ``abort`` (always one)."""

    components: list[str]
    dir_fd: int
    tmp: str
    fd: int
    owner: tuple[int, int]
    room: int | None = None   # bytes the volume's limit leaves (``Volume.limit``)

    def write(self, data: bytes) -> None:
        if self.room is not None:
            self.room -= len(data)
            if self.room < 0:
                raise VolumeFull(FULL)
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                raise _os_error(e, self.components) from None
            view = view[n:]

    def commit(self, *, mode: int | None, uid: int | None, gid: int | None,
               force: bool) -> dict[str, Any]:
        name = self.components[-1]
        try:
            os.fchown(self.fd, self.owner[0] if uid is None else uid,
                      self.owner[1] if gid is None else gid)
            os.fchmod(self.fd, DEFAULT_FILE_MODE if mode is None else mode)
            os.fsync(self.fd)  # a full volume says so here, not after the answer
        except OSError as e:
            raise _os_error(e, self.components) from None
        try:
            if force:
                try:
                    st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    if stat.S_ISDIR(st.st_mode):
                        raise PathConflict(f"Path {display(self.components)} is a directory")
                os.rename(self.tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            else:
                try:
                    os.link(self.tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd,
                            follow_symlinks=False)
                except FileExistsError:
                    raise PathConflict(f"Path {display(self.components)} exists") from None
            return _lstat_entry(self.dir_fd, self.components)
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the temporary file (after a commit only its name, if still linked)."""
        if self.fd < 0:
            return
        try:
            os.unlink(self.tmp, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        os.close(self.dir_fd)
        self.fd = -1


def _owner(root_fd: int) -> tuple[int, int]:
    st = os.fstat(root_fd)
    return st.st_uid, st.st_gid


def _set_owner(dir_fd: int, name: str, uid: int | None, gid: int | None) -> None:
    st = os.fstat(dir_fd)
    os.chown(name, st.st_uid if uid is None else uid, st.st_gid if gid is None else gid,
             dir_fd=dir_fd, follow_symlinks=False)


def _lstat_entry(dir_fd: int, components: list[str]) -> dict[str, Any]:
    name = components[-1]
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise PathNotFound(f"Path {display(components)} not found") from None
    target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
    return entry(components, st, target)


def _walk(dir_fd: int, components: list[str], depth: int, out: list[dict[str, Any]]) -> None:
    with os.scandir(dir_fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        if name.startswith(_TMP_PREFIX):
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        here = [*components, name]
        target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
        out.append(entry(here, st, target))
        if depth > 1 and stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                _walk(sub, here, depth - 1, out)
            finally:
                os.close(sub)


def _walk_error(e: OSError, components: list[str]) -> PathError:
    if isinstance(e, FileNotFoundError):
        return PathNotFound(f"Path {display(components)} not found")
    if e.errno in (40, 20):  # ELOOP (a symlink under O_NOFOLLOW), ENOTDIR
        return PathError(f"Path {display(components)} is a symbolic link or not a directory; "
                         "links are not followed in volumes")
    return _os_error(e, components)


def _os_error(e: OSError, components: list[str]) -> PathError:
    if e.errno in (28, 122):  # ENOSPC, EDQUOT
        return VolumeFull(FULL)
    if isinstance(e, FileExistsError):
        return PathConflict(f"Path {display(components)} exists")
    if isinstance(e, FileNotFoundError):
        return PathNotFound(f"Path {display(components)} not found")
    if isinstance(e, NotADirectoryError):
        return PathConflict(f"a part of {display(components)} is a file")
    return PathError(f"{display(components)}: {e.strerror}")


def tree_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of the blocks under ``root`` (links not followed): what a quota counts."""
    total = 0
    stack = [os.fspath(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total
