"""Users of the guest and the paths they name.

Every process and file operation runs as a named user: the one in the request (HTTP Basic
auth on RPCs, ``username`` on ``/files``) or the default user from ``/init``. Relative paths
resolve against that user's home, as upstream envd does, not against the working directory.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from base64 import b64decode
from dataclasses import dataclass

DEFAULT_SANDBOX_USER = "user"


class UnknownUser(Exception):
    """The requested user does not exist in the guest."""

    def __init__(self, name: str) -> None:
        super().__init__(f"invalid username: '{name}'")
        self.name = name


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]

    @classmethod
    def lookup(cls, name: str) -> User:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise UnknownUser(name) from None
        groups = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir, groups)


def basic_auth_user(header: str | None) -> str | None:
    """The user name of an ``Authorization: Basic base64(user:)`` header, else None."""
    if not header or not header.lower().startswith("basic "):
        return None
    try:
        decoded = b64decode(header[6:].strip()).decode()
    except ValueError:
        return None
    return decoded.split(":", 1)[0] or None


def resolve_path(path: str, user: User, default_workdir: str | None) -> str:
    """Absolute, normalised form of ``path`` as seen by ``user``.

    Empty means the default workdir (else home); ``~`` expands to home; a relative path is
    joined to home. Symlinks are not resolved: callers decide whether to follow them.
    """
    if not path:
        return os.path.normpath(default_workdir or user.home)
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    elif not path.startswith("/"):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)


def ensure_user(name: str = DEFAULT_SANDBOX_USER) -> None:
    """Create ``name`` with a home in /home when the guest lacks it (images built by aenv
    already have it). Needs root; a no-op elsewhere."""
    try:
        pwd.getpwnam(name)
        return
    except KeyError:
        pass
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        return
    subprocess.run(
        ["useradd", "--create-home", "--shell", "/bin/bash", name],
        check=False,
        capture_output=True,
    )


def owner_names(uid: int, gid: int) -> tuple[str, str]:
    """(user, group) names, falling back to the numbers when a name is unknown."""
    try:
        owner = pwd.getpwuid(uid).pw_name
    except KeyError:
        owner = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return owner, group
