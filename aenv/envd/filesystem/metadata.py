"""User metadata of a file, kept in ``user.e2b.<key>`` extended attributes.

Uploads write it (``X-Metadata-<Key>`` headers); Stat, ListDir and watch entries read it
back, including attributes set out of band (``setfattr``, ``os.setxattr``). Rules follow
upstream envd: printable ASCII keys and values, keys at most 246 bytes (the 255-byte xattr
name limit minus the prefix), at most 4096 bytes in all (one ext4 block).
"""

from __future__ import annotations

import errno
import os

PREFIX = "user.e2b."
MAX_KEY_LEN = 255 - len(PREFIX)
MAX_TOTAL_LEN = 4096
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP)


class InvalidMetadata(ValueError):
    """Metadata that can never be stored; the message says which rule it breaks."""


def validate(metadata: dict[str, str]) -> None:
    total = 0
    for key, value in metadata.items():
        if not key:
            raise InvalidMetadata("metadata key must not be empty")
        if len(key.encode()) > MAX_KEY_LEN:
            raise InvalidMetadata(f"metadata key {key!r} exceeds {MAX_KEY_LEN} bytes")
        _check_printable("key", key)
        _check_printable(f"value for key {key!r}", value)
        total += len(PREFIX) + len(key) + len(value)
    if total > MAX_TOTAL_LEN:
        raise InvalidMetadata(f"total metadata size {total} exceeds {MAX_TOTAL_LEN} bytes")


def _check_printable(label: str, text: str) -> None:
    for i, ch in enumerate(text):
        if not " " <= ch <= "~":
            raise InvalidMetadata(
                f"metadata {label} contains non-printable-ASCII character {ch!r} at offset {i}"
            )


def read(target: str | int) -> dict[str, str]:
    """The metadata of a path (symlinks followed) or an open descriptor.

    A filesystem without xattrs has none. Values that are not UTF-8 (possible when set out
    of band) are skipped: a protobuf string map cannot carry them.
    """
    try:
        names = os.listxattr(target)
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return {}
        raise
    found: dict[str, str] = {}
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            raw = os.getxattr(target, name)
        except OSError as e:
            if e.errno == errno.ENODATA:
                continue
            raise
        key = name[len(PREFIX) :]
        try:
            key.encode()
            found[key] = raw.decode()
        except UnicodeError:
            continue
    return found


def replace(fd: int, metadata: dict[str, str]) -> None:
    """Make ``metadata`` the file's whole metadata set.

    Keys not in ``metadata`` are removed, so an upload without metadata clears what an
    earlier upload left (O_TRUNC keeps xattrs). Nothing is touched when there is nothing
    to remove or set, which keeps an upload's inotify events to create, chmod, write.
    Raises OSError with ENOTSUP on filesystems without xattrs.
    """
    for name in os.listxattr(fd):
        if name.startswith(PREFIX) and name[len(PREFIX) :] not in metadata:
            try:
                os.removexattr(fd, name)
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise
    for key, value in metadata.items():
        os.setxattr(fd, PREFIX + key, value.encode())
