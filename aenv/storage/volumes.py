"""Volumes on the host: one sparse ext4 image per volume, loop-mounted, whose size is its quota.

Layout: ``<AENV_HOME>/volumes/<volume id>/`` holds ``data.img`` and the mountpoint ``root``.
The content API works on ``root`` directly (``volume_fs``); sandboxes reach it over NFS
(``volume_server``).

Why an image per volume rather than a directory with a quota: the node's filesystem is
whatever the host has (ext4 here, no ``prjquota``), and project quotas need XFS mounted with
them or ext4 made with them. A filesystem of its own gives a hard limit that every writer
meets the same way — the content API, the NFS server for every guest, a file written
through a fork — as ``ENOSPC``, with no accounting of our own. The image is sparse (a new
1 GiB volume takes a few MiB of disk), made with no reserved blocks, so the size given is
close to what can be stored. Cost: one loop device per volume while mounted.

A mounted volume stays mounted while the server runs and across its restarts (a restart
finds it mounted and takes it as is; two mounts of one image would corrupt it, so
``ensure_mounted`` never mounts one whose mountpoint is already a mount). A clean shutdown
unmounts the volumes nothing uses.

A node with a shared store (``AENV_SHARED_STORE``) keeps its volumes there instead, as
plain directories (``storage.shared_volumes``: an image on a shared directory must never be
loop-mounted by two nodes at once); ``volume_root`` and ``ensure_mounted`` answer for both,
so the NFS server (``volume_server``) serves either the same way.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

from ..config import Settings
from . import shared_volumes
from ._run import run
from .errors import CommandFailed, StorageError

log = logging.getLogger(__name__)

IMAGE = "data.img"
ROOT = "root"


class VolumeError(StorageError):
    """A volume's image could not be made, mounted or removed."""


def volumes_dir(settings: Settings) -> Path:
    """Where volumes live on this node (node-local; see the module docstring)."""
    return settings.home / "volumes"


def volume_root(settings: Settings, volume_id: str) -> Path:
    """The mounted filesystem of ``volume_id`` (what the content API and NFS serve); its
    directory in the shared store when the node has one."""
    if settings.shared_store is not None:
        return shared_volumes.root_in(settings.shared_store, volume_id)
    return volumes_dir(settings) / volume_id / ROOT


def is_mountpoint(path: Path) -> bool:
    """Whether ``path`` is a mount target in this mount namespace (from mountinfo, which,
    unlike ``os.path.ismount``, does not stat a hung or missing filesystem)."""
    target = os.fspath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(" ")
            if len(parts) > 4 and _unescape(parts[4]) == target:
                return True
    return False


def _unescape(field: str) -> str:
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def create(settings: Settings, volume_id: str, size_mb: int, owner: int = 1000) -> Path:
    """Make and mount a new volume of ``size_mb`` MiB whose root belongs to uid and gid
    ``owner`` (the sandbox user); returns its root. Undone on failure."""
    directory = volumes_dir(settings) / volume_id
    directory.mkdir(parents=True, exist_ok=False)
    try:
        image = directory / IMAGE
        with open(image, "wb") as f:
            f.truncate(size_mb * 1024 * 1024)
        # No reserved blocks (root's 5 %), a small journal, every inode table written now
        # (no lazy-init thread writing behind the volume's back).
        run(["mkfs.ext4", "-q", "-F", "-m", "0", "-J", "size=4", "-L", volume_id[:16],
             "-E", "lazy_itable_init=0,lazy_journal_init=0,root_owner=0:0", image])
        root = directory / ROOT
        root.mkdir()
        _mount(image, root)
        os.chmod(root, 0o755)
        os.chown(root, owner, owner)
        lost = root / "lost+found"
        if lost.is_dir():
            lost.rmdir()  # the user's tree starts empty; e2fsck makes it again if needed
        return root
    except BaseException:
        remove(settings, volume_id)
        raise


def _mount(image: Path, root: Path) -> None:
    try:
        run(["mount", "-t", "ext4", "-o", "loop,noatime,nodev,nosuid", image, root])
    except CommandFailed as e:
        raise VolumeError(f"cannot mount volume image {image}: {e.stderr_tail}") from e


def ensure_mounted(settings: Settings, volume_id: str) -> Path:
    """The root of an existing volume, mounted (after a reboot of the host, say); a shared
    volume's directory, which needs no mount, when the node has a shared store."""
    if settings.shared_store is not None:
        try:
            root = shared_volumes.root_in(settings.shared_store, volume_id)
        except shared_volumes.SharedVolumeError as e:
            raise VolumeError(str(e)) from e
        if not root.is_dir():
            raise VolumeError(f"volume {volume_id} has no directory in the shared store")
        return root
    directory = volumes_dir(settings) / volume_id
    root = directory / ROOT
    if is_mountpoint(root):
        return root
    image = directory / IMAGE
    if not image.is_file():
        raise VolumeError(f"volume {volume_id} has no image on this node")
    root.mkdir(exist_ok=True)
    _mount(image, root)
    return root


def unmount(settings: Settings, volume_id: str) -> bool:
    """Unmount a volume if nothing uses it; False when it is busy (kept mounted)."""
    root = volume_root(settings, volume_id)
    if not is_mountpoint(root):
        return True
    try:
        run(["umount", root])
    except CommandFailed as e:
        if "busy" in e.stderr_tail:
            return False
        raise VolumeError(f"cannot unmount volume {volume_id}: {e.stderr_tail}") from e
    return True


def remove(settings: Settings, volume_id: str) -> None:
    """Unmount and delete a volume's image. Raises ``VolumeError`` when it is in use."""
    if not unmount(settings, volume_id):
        raise VolumeError(f"volume {volume_id} is in use")
    directory = volumes_dir(settings) / volume_id
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass


def unmount_all(settings: Settings) -> list[str]:
    """At a clean shutdown: unmount every volume nobody uses; returns those still busy."""
    base = volumes_dir(settings)
    busy = []
    for d in sorted(base.iterdir()) if base.is_dir() else ():
        try:
            if not unmount(settings, d.name):
                busy.append(d.name)
        except VolumeError as e:
            log.warning("%s", e)
    return busy


def usage(settings: Settings, volume_id: str) -> tuple[int, int]:
    """(bytes used, bytes total) of a mounted volume."""
    try:
        st = os.statvfs(volume_root(settings, volume_id))
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise VolumeError(f"volume {volume_id} is not mounted") from e
        raise
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize
