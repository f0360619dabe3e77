"""``Volumes``: the lifecycle of E2B volumes on this node, between the API and the host.

Create inserts the record, makes and mounts the image (``storage.volumes``) and only then
marks it ready; a failure removes both. Delete refuses (409) while a sandbox that is not
ended mounts the volume — paused ones included, since their guests still hold it and
resume into it. ``resolve_mounts`` turns a create's ``volumeMounts`` (names, as the SDKs
send them) into what a sandbox record keeps: name, mount path and volume id.
"""

from __future__ import annotations

import asyncio
import posixpath
import re
from typing import Any

from ..config import Settings
from ..storage import volumes as host
from ..storage.volume_fs import Volume
from ..store import SandboxStore
from ..store.volumes import VolumeNameTaken, VolumeRecord, VolumeStore
from .errors import Conflict, InvalidRequest, OrchestratorError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MOUNTS = 16


class VolumeNotFound(OrchestratorError):
    status = 404

    def __init__(self, volume_id: str) -> None:
        super().__init__(f"Volume {volume_id} not found")


class Volumes:
    def __init__(self, store: VolumeStore, sandboxes: SandboxStore, settings: Settings) -> None:
        self.store, self.sandboxes, self.settings = store, sandboxes, settings
        self.size_mb = settings.volume_size_mb

    async def create(self, name: str, size_mb: int | None = None) -> VolumeRecord:
        """A new volume of ``size_mb`` MiB (at most, and by default, the node's
        ``volume_size_mb``)."""
        if size_mb is not None and size_mb > self.size_mb:
            raise InvalidRequest(f"sizeMB must be at most {self.size_mb} "
                                 "(AENV_VOLUME_SIZE_MB)")
        if not NAME.match(name):
            raise InvalidRequest("volume name must be 1-128 characters of letters, digits, "
                                 "'.', '_' and '-', starting with a letter or digit")
        try:
            rec = self.store.insert(name, size_mb or self.size_mb)
        except VolumeNameTaken as e:
            raise Conflict(str(e)) from None
        try:
            await asyncio.to_thread(host.create, self.settings, rec.id, rec.size_mb)
        except BaseException:
            self.store.delete(rec.id)
            raise
        self.store.set_ready(rec.id)
        rec.state = "ready"
        return rec

    def get(self, volume_id: str) -> VolumeRecord:
        rec = self.store.get(volume_id)
        if rec is None or rec.state != "ready":
            raise VolumeNotFound(volume_id)
        return rec

    def all(self) -> list[VolumeRecord]:
        return [r for r in self.store.list() if r.state == "ready"]

    def users(self, volume_id: str) -> list[str]:
        """Sandboxes not ended that mount ``volume_id``."""
        out = []
        for rec in self.sandboxes.live():
            if any(m.get("volumeID") == volume_id for m in rec.volume_mounts or ()):
                out.append(rec.id)
        return out

    async def delete(self, volume_id: str) -> None:
        rec = self.get(volume_id)
        if users := self.users(rec.id):
            raise Conflict(f"volume {rec.name} is mounted by sandbox {', '.join(users)}")
        try:
            await asyncio.to_thread(host.remove, self.settings, rec.id)
        except host.VolumeError as e:
            raise Conflict(f"volume {rec.name} is in use: {e}") from e
        self.store.delete(rec.id)

    async def content(self, volume_id: str) -> Volume:
        """The volume's files, mounted if needed (after a reboot of the host)."""
        rec = self.get(volume_id)
        root = await asyncio.to_thread(host.ensure_mounted, self.settings, rec.id)
        return Volume(str(root))

    def resolve_mounts(self, mounts: list[dict[str, Any]]) -> list[dict[str, str]]:
        """``[{name, path}]`` of a create → ``[{name, path, volumeID}]``, checked."""
        if len(mounts) > MAX_MOUNTS:
            raise InvalidRequest(f"at most {MAX_MOUNTS} volume mounts")
        out: list[dict[str, str]] = []
        paths: set[str] = set()
        for m in mounts:
            name, path = m.get("name"), m.get("path")
            if not isinstance(name, str) or not isinstance(path, str):
                raise InvalidRequest("volumeMounts entries need a name and a path")
            norm = posixpath.normpath(path)
            if not path.startswith("/") or norm == "/" or "\0" in path or "," in path:
                raise InvalidRequest(f"volume mount path {path!r} must be an absolute path "
                                     "other than /")
            if any(norm == p or norm.startswith(p + "/") or p.startswith(norm + "/")
                   for p in paths):
                raise InvalidRequest(f"volume mount path {norm} overlaps another mount")
            rec = self.store.by_name(name)
            if rec is None or rec.state != "ready":
                raise InvalidRequest(f"volume '{name}' does not exist")
            paths.add(norm)
            out.append({"name": rec.name, "path": norm, "volumeID": rec.id})
        return out

    def close(self) -> None:
        """At shutdown: unmount what no running sandbox uses."""
        host.unmount_all(self.settings)
