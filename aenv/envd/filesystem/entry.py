"""The ``EntryInfo`` of one path, exactly as upstream envd 0.6.13 reports it.

Taken from ``lstat`` (so ``name``, ``size``, ``permissions``, owner, group and mtime are the
link's own for a symlink), except that a symlink's ``type`` and ``mode`` are those of its
target and ``symlink_target`` is the target resolved to an absolute path (the link's own
path when it dangles). ``mode`` is the permission bits only; ``permissions`` is Go's
``FileMode.String()`` (``-rw-r--r--``, ``drwxr-xr-x``, ``Lrwxrwxrwx``). ``is_symlink`` stays
false, as envd 0.6.13 leaves it. Metadata is best-effort: a failure to read xattrs never
fails the entry.
"""

from __future__ import annotations

import os
import stat

from protobuf.wkt import Timestamp

from ..proto import filesystem_pb as pb
from ..users import owner_names
from . import metadata

# Go's FileMode type letters in the order String() prints them, as predicates on st_mode.
_TYPE_LETTERS = (
    ("d", stat.S_ISDIR),
    ("L", stat.S_ISLNK),
    ("D", lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m)),
    ("p", stat.S_ISFIFO),
    ("S", stat.S_ISSOCK),
    ("u", lambda m: bool(m & stat.S_ISUID)),
    ("g", lambda m: bool(m & stat.S_ISGID)),
    ("c", stat.S_ISCHR),
    ("t", lambda m: bool(m & stat.S_ISVTX)),
)
_RWX = "rwxrwxrwx"

NameCache = dict[tuple[int, int], tuple[str, str]]


def go_permissions(st_mode: int) -> str:
    """``FileMode.String()`` of a Go ``os.FileMode`` built from ``st_mode``."""
    letters = "".join(ch for ch, test in _TYPE_LETTERS if test(st_mode)) or "-"
    bits = "".join(c if st_mode & (1 << (8 - i)) else "-" for i, c in enumerate(_RWX))
    return letters + bits


def file_type(st_mode: int) -> pb.FileType:
    if stat.S_ISREG(st_mode):
        return pb.FileType.FILE
    if stat.S_ISDIR(st_mode):
        return pb.FileType.DIRECTORY
    if stat.S_ISLNK(st_mode):
        return pb.FileType.SYMLINK
    return pb.FileType.UNSPECIFIED


def base_name(path: str) -> str:
    """Go's ``filepath.Base``: the last element, ``/`` for the root."""
    return os.path.basename(path.rstrip("/")) or "/"


def entry_info(path: str, names: NameCache | None = None) -> pb.EntryInfo:
    """EntryInfo of ``path`` (absolute, not resolved). Raises OSError from ``lstat``.

    ``names`` caches owner/group lookups across the entries of one listing.
    """
    st = os.lstat(path)
    target: str | None = None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
        except OSError:
            target = path
        try:
            target_mode = os.stat(target).st_mode
            kind, mode = file_type(target_mode), target_mode & 0o777
        except OSError:
            kind, mode = pb.FileType.UNSPECIFIED, 0
    else:
        kind, mode = file_type(st.st_mode), st.st_mode & 0o777

    key = (st.st_uid, st.st_gid)
    if names is not None and key in names:
        owner, group = names[key]
    else:
        owner, group = owner_names(*key)
        if names is not None:
            names[key] = (owner, group)

    try:
        meta = metadata.read(path)
    except OSError:
        meta = {}

    sec, nsec = divmod(st.st_mtime_ns, 1_000_000_000)
    return pb.EntryInfo(
        name=base_name(path),
        type=kind,
        path=path,
        size=st.st_size,
        mode=mode,
        permissions=go_permissions(st.st_mode),
        owner=owner,
        group=group,
        modified_time=Timestamp(seconds=sec, nanos=nsec) if st.st_mtime_ns else None,
        symlink_target=target,
        metadata=meta or None,
    )
