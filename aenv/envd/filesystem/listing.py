"""ListDir: the entries below a directory, down to a depth, in Go ``WalkDir`` order.

Order is lexical (by the names' bytes) depth-first pre-order: a directory is followed by
its own descendants before its next sibling. The requested path may be a symlink to a
directory, which is followed; entry paths are still built from the requested path.
Symlinks below it are reported (with their target's type) but never descended into.
Entries that vanish during the walk are skipped. Blocking: run it in a worker thread.
"""

from __future__ import annotations

import errno
import os

from ..proto import filesystem_pb as pb
from .entry import NameCache, entry_info
from .errors import InvalidPath, NotFound, SymlinkLoop, from_os_error


def resolve_directory(path: str) -> str:
    """The real path of directory ``path``; NotFound, SymlinkLoop or InvalidPath otherwise."""
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SymlinkLoop(f"cyclic symlink or chain >255 links at {path!r}") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise NotFound(f"path not found: {path}") from None
        raise from_os_error(e, "error resolving symlink") from None
    if not os.path.isdir(real):
        raise InvalidPath(f"path is not a directory: {path}")
    return real


def list_dir(path: str, depth: int) -> list[pb.EntryInfo]:
    """Entries below ``path`` (absolute) down to ``depth`` levels (0 counts as 1)."""
    real = resolve_directory(path)
    entries: list[pb.EntryInfo] = []
    _walk(real, path, max(depth, 1), entries, {}, top=True)
    return entries


def _walk(
    real: str, shown: str, levels: int, out: list[pb.EntryInfo], names: NameCache, top: bool
) -> None:
    try:
        with os.scandir(real) as it:
            children = sorted(it, key=lambda e: os.fsencode(e.name))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR) and not top:
            return  # a subdirectory vanished or was replaced while we walked
        raise from_os_error(e, f"error reading directory {real}") from None
    for child in children:
        if not _is_utf8(child.name):
            continue  # a protobuf string cannot carry the name
        shown_path = os.path.join(shown, child.name)
        try:
            info = entry_info(child.path, names)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise from_os_error(e, f"error getting file info of {child.path}") from None
        info.path = shown_path
        out.append(info)
        if levels > 1 and child.is_dir(follow_symlinks=False):
            _walk(child.path, shown_path, levels - 1, out, names, top=False)


def _is_utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True
