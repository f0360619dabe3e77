"""``Volumes``: the lifecycle of E2B volumes on this node, between the API and the host.

Create inserts the record, makes and mounts the image (``storage.volumes``) and only then
marks it ready; a failure removes both. Delete refuses (409) while a sandbox that is not
ended mounts the volume — paused ones included, since their guests still hold it and
resume into it. ``resolve_mounts`` turns a create's ``volumeMounts`` (names, as the SDKs
send them) into what a sandbox record keeps: name, mount path and volume id.

With a shared store (``shared``: ``storage.shared_volumes``), records and files live
there and any node serves any volume: the delete check is cluster-wide (this node's
store, plus every other node's fresh users file), this node's users file is rewritten
when a create that mounts volumes starts and ends (``resolve_mounts``, ``release``) and
every ``USERS_REFRESH_S`` (``keep_users``), and uploads are held to the volume's size by
the content API where the store has no hard quota.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import re
from collections import Counter, defaultdict
from typing import Any

from ..config import Settings
from ..storage import volumes as host
from ..storage.shared_volumes import USERS_REFRESH_S, SharedVolumes
from ..storage.volume_fs import Volume
from ..store import SandboxStore
from ..store.volumes import VolumeNameTaken, VolumeRecord, VolumeStore
from .errors import Conflict, InvalidRequest, OrchestratorError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MOUNTS = 16
MIB = 1024 * 1024

log = logging.getLogger(__name__)


class VolumeNotFound(OrchestratorError):
    status = 404

    def __init__(self, volume_id: str) -> None:
        super().__init__(f"Volume {volume_id} not found")


class Volumes:
    def __init__(self, store: VolumeStore, sandboxes: SandboxStore, settings: Settings,
                 shared: SharedVolumes | None = None) -> None:
        self.sandboxes, self.settings, self.shared = sandboxes, settings, shared
        self.store: VolumeStore | SharedVolumes = shared if shared is not None else store
        self.size_mb = settings.volume_size_mb
        # Creates in flight that will mount a volume, by volume id (shared volumes).
        self._pending: Counter[str] = Counter()

    async def create(self, name: str, size_mb: int | None = None) -> VolumeRecord:
        """A new volume of ``size_mb`` MiB (at most, and by default, the node's
        ``volume_size_mb``)."""
        if size_mb is not None and size_mb > self.size_mb:
            raise InvalidRequest(f"sizeMB must be at most {self.size_mb} "
                                 "(AENV_VOLUME_SIZE_MB)")
        if not NAME.match(name):
            raise InvalidRequest("volume name must be 1-128 characters of letters, digits, "
                                 "'.', '_' and '-', starting with a letter or digit")
        if self.shared is not None:
            return await self._create_shared(self.shared, name, size_mb or self.size_mb)
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

    async def _create_shared(self, shared: SharedVolumes, name: str,
                             size_mb: int) -> VolumeRecord:
        try:
            rec = await asyncio.to_thread(shared.insert, name, size_mb)
        except VolumeNameTaken as e:
            raise Conflict(str(e)) from None
        try:
            _, quota, project = await asyncio.to_thread(shared.make_root, rec.id, size_mb)
            await asyncio.to_thread(shared.set_ready, rec.id, quota=quota, project=project)
        except BaseException:
            await asyncio.to_thread(shared.remove_root, rec.id)
            await asyncio.to_thread(shared.delete, rec.id)
            raise
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
        """Sandboxes not ended that mount ``volume_id``: this node's, and with a shared
        store those every other node last said it has (and creates in flight)."""
        out = []
        for rec in self.sandboxes.live():
            if any(m.get("volumeID") == volume_id for m in rec.volume_mounts or ()):
                out.append(rec.id)
        if self.shared is not None:
            if self._pending[volume_id] > 0:
                out.append(f"{self._pending[volume_id]} being created")
            out += self.shared.users(volume_id, other_nodes_only=True)
        return out

    def _users_here(self) -> dict[str, list[str]]:
        """This node's users of each volume: its live sandboxes, and creates in flight."""
        out: defaultdict[str, list[str]] = defaultdict(list)
        for rec in self.sandboxes.live():
            for m in rec.volume_mounts or ():
                out[m["volumeID"]].append(rec.id)
        for volume_id, n in self._pending.items():
            if n > 0:
                out[volume_id].append(f"{n} being created")
        return out

    def publish_users(self) -> None:
        """Write this node's users file to the shared store (blocking I/O)."""
        if self.shared is not None:
            self.shared.publish_users(self._users_here())

    async def sandbox_stopped(self, sandbox_id: str) -> None:
        """An ``Orchestrator.on_stop`` hook: a sandbox of this node ended, so its users file
        says so now, not at the next refresh (a delete right after a kill, sent to another
        node, would otherwise be refused for up to ``USERS_REFRESH_S``)."""
        if self.shared is not None:
            await self._publish_users_logged()

    async def _publish_users_logged(self) -> None:
        """``publish_users`` off the event loop; a failure to write is logged, not raised:
        the next refresh (``keep_users``) says it."""
        try:
            await asyncio.to_thread(self.publish_users)
        except OSError as e:
            log.warning("cannot write this node's volume users to the shared store: %s", e)

    async def keep_users(self) -> None:
        """Rewrite this node's users file every ``USERS_REFRESH_S``, until cancelled."""
        while True:
            await self._publish_users_logged()
            await asyncio.sleep(USERS_REFRESH_S)

    async def release(self, mounts: list[dict[str, str]]) -> None:
        """A create that ``resolve_mounts`` resolved ``mounts`` for has ended (made or
        not): its sandbox's record, if any, counts from now on instead."""
        if self.shared is None:
            return
        for m in mounts:
            self._pending[m["volumeID"]] -= 1
            if self._pending[m["volumeID"]] <= 0:
                del self._pending[m["volumeID"]]
        await self._publish_users_logged()

    async def delete(self, volume_id: str) -> None:
        if self.shared is not None:
            return await self._delete_shared(self.shared, volume_id)
        rec = self.get(volume_id)
        if users := self.users(rec.id):
            raise Conflict(f"volume {rec.name} is mounted by sandbox {', '.join(users)}")
        try:
            await asyncio.to_thread(host.remove, self.settings, rec.id)
        except host.VolumeError as e:
            raise Conflict(f"volume {rec.name} is in use: {e}") from e
        self.store.delete(rec.id)

    async def _delete_shared(self, shared: SharedVolumes, volume_id: str) -> None:
        """Mark the delete first, then read who mounts it (``shared_volumes``: a create
        marks first, then reads the record, which the mark hides)."""
        rec = self.get(volume_id)
        if not await asyncio.to_thread(shared.begin_delete, rec.id):
            raise Conflict(f"volume {rec.name} is being deleted")
        try:
            if users := await asyncio.to_thread(self.users, rec.id):
                raise Conflict(f"volume {rec.name} is mounted by sandbox {', '.join(users)}")
            # The record first: the volume is gone for every node at once, and a delete
            # asked again while a large tree is removed finds none (404).
            await asyncio.to_thread(shared.delete, rec.id)
            await asyncio.to_thread(shared.remove_root, rec.id)
        finally:
            await asyncio.to_thread(shared.end_delete, rec.id)

    async def content(self, volume_id: str) -> Volume:
        """The volume's files, mounted if needed (after a reboot of the host); a shared
        volume without a hard quota is held to its size by the content API."""
        rec = self.get(volume_id)
        root = await asyncio.to_thread(host.ensure_mounted, self.settings, rec.id)
        if self.shared is not None and \
                await asyncio.to_thread(self.shared.quota, rec.id) != "xfs":
            return Volume(str(root), limit=rec.size_mb * MIB)
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
        if self.shared is not None:
            self._hold(out)
        return out

    def _hold(self, mounts: list[dict[str, str]]) -> None:
        """Count a create's volumes as used (in this node's users file) before it goes on,
        then check that no delete of one began (its mark hides the record): the caller
        must ``release`` them once the create ends."""
        for m in mounts:
            self._pending[m["volumeID"]] += 1
        try:
            self.publish_users()
            for m in mounts:
                if self.store.get(m["volumeID"]) is None:
                    raise InvalidRequest(f"volume '{m['name']}' does not exist")
        except BaseException:
            for m in mounts:
                self._pending[m["volumeID"]] -= 1
            with contextlib.suppress(OSError):
                self.publish_users()
            raise

    def close(self) -> None:
        """At shutdown: unmount what no running sandbox uses."""
        host.unmount_all(self.settings)
