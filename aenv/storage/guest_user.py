"""E2B's ``user`` in a root-filesystem tree, written from Python (no chroot, no useradd).

Images from a registry rarely have the user E2B's SDK runs everything as (``user``, uid
1000, home ``/home/user``), and may have neither a shell nor a libc to run ``useradd``
with. ``add_user`` edits the tree's ``/etc/passwd``, ``/etc/group`` and (when the image has
one) ``/etc/shadow`` directly, as useradd would: a group of the same name, the image's
own shell (``/bin/bash`` if present, else ``/bin/sh``), a locked password, and a home
owned by the user. An existing ``user`` is kept as it is. When uid or gid 1000 is taken
(``node`` images have a ``node`` user there), the next free number from 1000 up is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import tar_layers
from .errors import ImageError

FIRST_ID = 1000
_DAYS_SINCE_EPOCH = 19000  # shadow's "last changed"; fixed so the same tree gives one image


@dataclass(frozen=True)
class GuestUser:
    name: str
    uid: int
    gid: int
    home: str
    shell: str
    created: bool  # False: the image already had it


def add_user(tree: Path, name: str, *, uid: int = FIRST_ID, home: str | None = None
             ) -> GuestUser:
    """``name`` in ``tree`` (created unless it is there already)."""
    if not name or any(c in name for c in ":\n/") or name.startswith("-"):
        raise ImageError(f"bad user name {name!r}")
    passwd_path = _etc(tree, "passwd")
    passwd = _read_table(passwd_path)
    for row in passwd:
        if row[0] == name and len(row) >= 7:
            return GuestUser(name, int(row[2]), int(row[3]), row[5], row[6], created=False)
    group_path = _etc(tree, "group")
    groups = _read_table(group_path)
    home = home or f"/home/{name}"
    shell = "/bin/bash" if os.path.lexists(tar_layers.resolve(tree, "bin/bash")) else "/bin/sh"
    taken_uids = {int(r[2]) for r in passwd if len(r) > 2 and r[2].isdigit()}
    taken_gids = {int(r[2]) for r in groups if len(r) > 2 and r[2].isdigit()}
    group = next((r for r in groups if r[0] == name), None)
    uid = _free(uid, taken_uids)
    # As useradd --user-group: the group's number is the user's when that is free.
    gid = int(group[2]) if group is not None else _free(uid, taken_gids)
    passwd.append([name, "x", str(uid), str(gid), "", home, shell])
    _write_table(passwd_path, passwd, 0o644)
    if group is None:
        groups.append([name, "x", str(gid), ""])
        _write_table(group_path, groups, 0o644)
    shadow_path = _etc(tree, "shadow")
    if os.path.isfile(shadow_path):
        shadow = _read_table(shadow_path)
        shadow = [r for r in shadow if r[0] != name]
        shadow.append([name, "!", str(_DAYS_SINCE_EPOCH), "0", "99999", "7", "", "", ""])
        _write_table(shadow_path, shadow, 0o640)
    home_dir = Path(tar_layers.resolve(tree, home.lstrip("/")))
    home_dir.mkdir(parents=True, exist_ok=True)
    os.chown(home_dir, uid, gid)
    os.chmod(home_dir, 0o750)
    return GuestUser(name, uid, gid, home, shell, created=True)


def _free(wanted: int, taken: set[int]) -> int:
    while wanted in taken:
        wanted += 1
    return wanted


def _etc(tree: Path, name: str) -> Path:
    return Path(tar_layers.resolve(tree, f"etc/{name}"))


def _read_table(path: Path) -> list[list[str]]:
    """Rows of a colon-separated table (comments and blank lines dropped: tools that
    rewrite these files drop them too). A missing file is an empty table."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [line.split(":") for line in text.splitlines()
            if line.strip() and not line.startswith("#")]


def _write_table(path: Path, rows: list[list[str]], mode: int) -> None:
    """Replace ``path`` whole (a new inode), keeping its mode and owner; a new file gets
    ``mode`` and root."""
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = (0, 0)
    try:
        st = os.stat(path)
        mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.aenv-tmp")
    tmp.write_text("".join(":".join(r) + "\n" for r in rows))
    os.chown(tmp, *owner)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
