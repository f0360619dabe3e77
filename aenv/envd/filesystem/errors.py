"""Filesystem failures as named exceptions, independent of the transport.

The Connect service turns them into Connect codes and ``/files`` into HTTP statuses, each
in one place, so a module that touches the disk only says *what* went wrong.
"""

from __future__ import annotations

import errno


class FilesystemError(Exception):
    """Base: an operation failed for a reason the caller cannot fix (Connect ``internal``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(FilesystemError):
    """The path (or a component of it) does not exist."""


class AlreadyExists(FilesystemError):
    """The directory to create is already there."""


class InvalidPath(FilesystemError):
    """The path exists but is the wrong kind of thing (file for a directory, or back)."""


class SymlinkLoop(FilesystemError):
    """Resolving the path ran into a symlink cycle."""


class PermissionDenied(FilesystemError):
    """The kernel refused the operation (EACCES, EPERM, EROFS) even though envd is root."""


class NoSpace(FilesystemError):
    """The disk or its inodes are full (ENOSPC, EDQUOT)."""


def from_os_error(err: OSError, what: str) -> FilesystemError:
    """Classify ``err``; ``what`` says what was being done, e.g. ``"error removing"``."""
    detail = f"{what}: {err.strerror or err}" + (f": {err.filename}" if err.filename else "")
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(detail)
    if err.errno == errno.ELOOP:
        return SymlinkLoop(detail)
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(detail)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(detail)
    if err.errno == errno.EEXIST:
        return AlreadyExists(detail)
    if err.errno == errno.EISDIR:
        return InvalidPath(detail)
    return FilesystemError(detail)
