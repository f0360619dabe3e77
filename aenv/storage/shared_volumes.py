"""Volumes in the cluster's shared store (``AENV_SHARED_STORE``): any node serves any of them.

A node with a shared store keeps its E2B volumes here instead of in node-local images
(``aenv.storage.volumes``), so every node's per-sandbox NFS server (``volume_server``) and
content API (``volume_fs``) work on the same directory, and a node going away takes no
volume with it. Layout under ``<shared store>/volumes/``::

    data/<id>/root         the volume's files (a directory, not an image: an image on a
                           shared filesystem must never be loop-mounted by two nodes)
    records/<id>.json      its record: id, name, token, size, state, created, quota kind
    names/<name>           the id of the volume that holds the name (see below)
    deleting/<id>          a delete in progress (its time); see "Delete"
    users/<node>.json      what each node's sandboxes mount; see "Delete"
    snapshots/<id>.json    the volume mounts of a shared persistent snapshot (template
                           id): its sandboxes mount them on any node, where its source
                           sandbox's record is not

**Records.** The shared store is the truth, not Redis and not a node's SQLite: a record
is written atomically (``durable.write_atomic``: temp file, fsync, rename), so every node
reads a whole one, and it survives Redis losing its data and any node being lost. Redis
only says which nodes serve shared volumes (``NodeRecord.shared_volumes``). Names are
unique through the filesystem: a create links a complete file holding its id to
``names/<name>`` (``link`` refuses an existing name atomically, on NFS too, unlike
``O_EXCL`` on old NFS clients). A name entry without a record is a create in progress,
or one that crashed: after ``CLAIM_STALE_S`` it is taken back. A record says ``creating``
until the data directory is made, then ``ready``.

**Quota.** A directory has no size by itself. When the store's filesystem is XFS mounted
with project quotas (``prjquota``), each volume's directory is its own project (id from
the record) with a hard block limit of its size (``xfs_quota``): every writer, the content
API and every guest over NFS on every node, meets ``EDQUOT`` at the limit, and ``statfs``
of the directory reports the volume's size. Elsewhere (NFS, CephFS, ext4 shared stores)
the size is *soft*: the content API refuses an upload that would take the volume over it
(``volume_fs.Volume(limit=...)``: 507, as a full volume), counting the blocks of the tree
at the upload's start, but guests writing over NFS are bounded only by the filesystem.
The record's ``quota`` says which (``"xfs"`` or ``"soft"``).

**Delete** is refused while any sandbox on any node that is not ended (paused included)
mounts the volume. Each node writes ``users/<node>.json`` (volume id -> its live
sandboxes that mount it, and creates in flight that will) whenever that changes and every
``USERS_REFRESH_S``; an entry counts while its file is younger than ``USERS_STALE_S``. So
a dead node's sandboxes stop blocking a delete ``USERS_STALE_S`` after its last write; if
that node comes back with paused sandboxes on the deleted volume, their mount paths fail
(``ESTALE``) after resume. The race of a delete with a create that mounts the volume is
closed by each side marking first and checking the other after: a delete makes
``deleting/<id>`` (atomic create) and only then reads the users; a create writes its node's
users file and only then reads the record, which ``get`` hides while a delete is marked.
Clocks of the nodes are taken to agree within seconds (the stale time is compared with
the writer's own time).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

from ..store.volumes import VolumeNameTaken, VolumeRecord, new_volume_id
from . import durable
from .errors import StorageError
from .volume_fs import tree_bytes

log = logging.getLogger(__name__)

VOLUMES = "volumes"
# A name entry with no record this old is a crashed create's: taken back.
CLAIM_STALE_S = 600.0
# A delete's mark this old is a crashed delete's: the volume is visible again.
DELETE_STALE_S = 300.0
# How often a node rewrites its users file, and how old one may be and still count.
USERS_REFRESH_S = 5.0
USERS_STALE_S = 60.0
XFS_MAGIC = 0x58465342
_XFS_QUOTA = "xfs_quota"


class SharedVolumeError(StorageError):
    """A shared volume's directory, record or quota could not be made or removed."""


class SharedVolumes:
    """The records, names, data directories and users of the shared store's volumes, as
    seen from node ``node_id``. Every method is blocking file I/O: call from a thread
    where the store may be slow (NFS)."""

    def __init__(self, store_root: Path, node_id: str,
                 users_stale_s: float = USERS_STALE_S) -> None:
        self.base = Path(store_root) / VOLUMES
        self.node_id = node_id
        self.users_stale_s = users_stale_s
        for d in ("data", "records", "names", "deleting", "users", "trash", "snapshots"):
            (self.base / d).mkdir(parents=True, exist_ok=True)

    # -- paths

    def root(self, volume_id: str) -> Path:
        """The volume's files (what NFS and the content API serve)."""
        return root_in(self.base.parent, volume_id)

    def _record(self, volume_id: str) -> Path:
        return self.base / "records" / f"{_checked(volume_id)}.json"

    def _name(self, name: str) -> Path:
        return self.base / "names" / _checked(name)

    def _deleting(self, volume_id: str) -> Path:
        return self.base / "deleting" / _checked(volume_id)

    # -- records (the ``VolumeStore`` interface)

    def insert(self, name: str, size_mb: int) -> VolumeRecord:
        """A new volume in state ``creating`` holding ``name``; ``VolumeNameTaken`` when
        another volume holds it (or a create of it runs)."""
        rec = VolumeRecord(id=new_volume_id(), name=name, token=secrets.token_urlsafe(32),
                           size_mb=size_mb, state="creating", created_at=time.time())
        self._claim(name, rec.id)
        try:
            self._write(rec, quota="soft")
        except BaseException:
            self._release(name, rec.id)
            raise
        return rec

    def _claim(self, name: str, volume_id: str) -> None:
        entry = self._name(name)
        tmp = entry.with_name(f".{name}.{secrets.token_hex(6)}.tmp")
        with open(tmp, "w") as f:
            f.write(volume_id)
            f.flush()
            os.fsync(f.fileno())   # the entry never names nothing after a crash
        try:
            for _ in range(2):
                try:
                    os.link(tmp, entry)
                    durable.fsync_dir(entry.parent)
                    return
                except FileExistsError:
                    if not self._take_back_stale(name):
                        raise VolumeNameTaken(name) from None
            raise VolumeNameTaken(name)
        finally:
            tmp.unlink(missing_ok=True)

    def _take_back_stale(self, name: str) -> bool:
        """Remove the entry of ``name`` when the create that made it did not finish (no
        record, or one still ``creating``) and is older than ``CLAIM_STALE_S``, with what
        that create left; True when removed."""
        entry = self._name(name)
        try:
            holder = entry.read_text().strip()
            age = time.time() - entry.stat().st_mtime
        except FileNotFoundError:
            return True
        try:
            recorded = self._record(holder).exists()
        except SharedVolumeError:   # an entry that names no volume at all
            recorded = False
            holder = ""
        rec = self._load(holder) if recorded else None
        if age < CLAIM_STALE_S or (recorded and (rec is None or rec.state != "creating")):
            return False
        log.warning("volume name %s: taking back the claim of a create that did not "
                    "finish (%s, %.0f s old)", name, holder, age)
        if not holder:
            entry.unlink(missing_ok=True)
            return True
        with contextlib.suppress(SharedVolumeError, OSError):
            self.remove_root(holder)
        self._record(holder).unlink(missing_ok=True)
        self._release(name, holder)
        return True

    def _release(self, name: str, volume_id: str) -> None:
        """Unlink the name entry if it still names ``volume_id``."""
        entry = self._name(name)
        with contextlib.suppress(FileNotFoundError):
            if entry.read_text().strip() == volume_id:
                entry.unlink()

    def _write(self, rec: VolumeRecord, *, quota: str, project: int = 0) -> None:
        data = {"id": rec.id, "name": rec.name, "token": rec.token, "size_mb": rec.size_mb,
                "state": rec.state, "created_at": rec.created_at, "quota": quota,
                "project": project}
        durable.write_atomic(self._record(rec.id), json.dumps(data).encode(), mode=0o600)

    def _raw(self, volume_id: str) -> dict[str, object] | None:
        try:
            data: dict[str, object] = json.loads(self._record(volume_id).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return data

    def set_ready(self, volume_id: str, *, quota: str = "soft", project: int = 0) -> None:
        rec = self._load(volume_id)
        if rec is None:
            raise SharedVolumeError(f"volume {volume_id} has no record")
        rec.state = "ready"
        self._write(rec, quota=quota, project=project)

    def _load(self, volume_id: str) -> VolumeRecord | None:
        data = self._raw(volume_id)
        if data is None:
            return None
        try:
            return VolumeRecord(id=str(data["id"]), name=str(data["name"]),
                                token=str(data["token"]), size_mb=int(str(data["size_mb"])),
                                state=str(data["state"]),
                                created_at=float(str(data["created_at"])))
        except (KeyError, ValueError):
            log.warning("volume %s: unreadable record", volume_id)
            return None

    def get(self, volume_id: str) -> VolumeRecord | None:
        """The record, None when there is none or a delete of it is under way."""
        try:
            _checked(volume_id)
        except SharedVolumeError:
            return None
        if self._delete_marked(volume_id):
            return None
        return self._load(volume_id)

    def quota(self, volume_id: str) -> str:
        """``"xfs"`` (hard) or ``"soft"`` (the content API's check only)."""
        data = self._raw(volume_id) or {}
        return str(data.get("quota", "soft"))

    def by_name(self, name: str) -> VolumeRecord | None:
        try:
            holder = self._name(name).read_text().strip()
        except (FileNotFoundError, SharedVolumeError):
            return None
        rec = self.get(holder)
        return rec if rec is not None and rec.name == name else None

    def delete(self, volume_id: str) -> bool:
        """Remove the record and release the name (the data: ``remove_root``)."""
        rec = self._load(volume_id)
        if rec is None:
            return False
        self._record(volume_id).unlink(missing_ok=True)
        durable.fsync_dir(self._record(volume_id).parent)
        self._release(rec.name, volume_id)
        return True

    # -- data

    def make_root(self, volume_id: str, size_mb: int, owner: int = 1000) -> tuple[Path, str, int]:
        """Make the volume's directory, owned by uid and gid ``owner`` (the sandbox user),
        with an XFS project quota of ``size_mb`` where the store has them; returns (root,
        quota kind, project id)."""
        root = self.root(volume_id)
        root.mkdir(parents=True, exist_ok=False)
        os.chmod(root, 0o755)
        os.chown(root, owner, owner)
        project = project_id(volume_id)
        try:
            if xfs_project_quotas(root):
                set_project_quota(root, project, size_mb)
                return root, "xfs", project
        except SharedVolumeError:
            shutil.rmtree(root.parent, ignore_errors=True)
            raise
        return root, "soft", 0

    def remove_root(self, volume_id: str) -> None:
        """Delete the volume's files: moved out of the way first (atomic), then removed."""
        directory = self.base / "data" / _checked(volume_id)
        trash = self.base / "trash" / f"{volume_id}-{secrets.token_hex(4)}"
        try:
            os.rename(directory, trash)
        except FileNotFoundError:
            return
        project = project_id(volume_id)
        shutil.rmtree(trash, ignore_errors=True)
        with contextlib.suppress(SharedVolumeError):
            if xfs_project_quotas(self.base):
                clear_project_quota(self.base, project)

    def used_bytes(self, volume_id: str) -> int:
        """The blocks the volume's files take, in bytes (a walk of the tree)."""
        return tree_bytes(self.root(volume_id))

    # -- delete, cluster-wide

    def _delete_marked(self, volume_id: str) -> bool:
        try:
            at = float(self._deleting(volume_id).read_text() or "0")
        except (FileNotFoundError, ValueError):
            return False
        return time.time() - at < DELETE_STALE_S

    def begin_delete(self, volume_id: str) -> bool:
        """Mark a delete of ``volume_id`` under way (``get`` hides it from now on); False
        when another delete holds the mark."""
        mark = self._deleting(volume_id)
        if mark.exists() and not self._delete_marked(volume_id):
            mark.unlink(missing_ok=True)  # a crashed delete's
        try:
            fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(str(time.time()))
            f.flush()
            os.fsync(f.fileno())
        return True

    def end_delete(self, volume_id: str) -> None:
        self._deleting(volume_id).unlink(missing_ok=True)

    def publish_users(self, users: Mapping[str, list[str]]) -> None:
        """This node's sandboxes (and creates in flight) that mount each volume."""
        data = {"node": self.node_id, "at": time.time(),
                "volumes": {v: sorted(s) for v, s in users.items() if s}}
        durable.write_atomic(self.base / "users" / f"{_checked(self.node_id)}.json",
                             json.dumps(data).encode())

    def users(self, volume_id: str, *, other_nodes_only: bool = False) -> list[str]:
        """``<sandbox> (node <id>)`` for every sandbox of a node whose users file is fresh
        (``users_stale_s``) that mounts ``volume_id``."""
        out = []
        now = time.time()
        for f in sorted((self.base / "users").glob("*.json")):
            try:
                data = json.loads(f.read_bytes())
                node, at = str(data["node"]), float(data["at"])
                mounts = data["volumes"].get(volume_id) or []
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if other_nodes_only and node == self.node_id:
                continue
            if now - at > self.users_stale_s:
                continue
            out += [f"{s} (node {node})" for s in mounts]
        return out


    # -- persistent snapshots' mounts

    def put_snapshot_mounts(self, template_id: str, mounts: list[dict[str, str]]) -> None:
        durable.write_atomic(self.base / "snapshots" / f"{_checked(template_id)}.json",
                             json.dumps(mounts).encode())

    def snapshot_mounts(self, template_id: str) -> list[dict[str, str]] | None:
        try:
            raw = (self.base / "snapshots" / f"{_checked(template_id)}.json").read_bytes()
            mounts: list[dict[str, str]] = json.loads(raw)
        except (OSError, ValueError, SharedVolumeError):
            return None
        return mounts

    def drop_snapshot_mounts(self, template_id: str) -> None:
        with contextlib.suppress(SharedVolumeError):
            (self.base / "snapshots" / f"{_checked(template_id)}.json").unlink(missing_ok=True)

    # last: its name would hide the builtin in the annotations after it
    def list(self) -> list[VolumeRecord]:
        out = []
        for f in (self.base / "records").glob("vol_*.json"):
            rec = self.get(f.stem)
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: (r.created_at, r.id))


def root_in(store_root: Path, volume_id: str) -> Path:
    """Where the files of shared volume ``volume_id`` are in the store at ``store_root``."""
    return Path(store_root) / VOLUMES / "data" / _checked(volume_id) / "root"


def _checked(part: str) -> str:
    """``part`` as one path component (an id, a name or a node id), or an error."""
    if not part or part in (".", "..") or "/" in part or "\0" in part or part.startswith("."):
        raise SharedVolumeError(f"{part!r} cannot name a shared volume's file")
    return part


def project_id(volume_id: str) -> int:
    """The XFS project of a volume (from its id: no shared counter to keep)."""
    return (zlib.crc32(volume_id.encode()) & 0x7FFFFFFF) or 1


# -- XFS project quotas


def xfs_project_quotas(path: Path) -> bool:
    """Whether ``path`` is on XFS with project quotas enforced (``prjquota``)."""
    try:
        if _fs_type(path) != XFS_MAGIC or shutil.which(_XFS_QUOTA) is None:
            return False
        out = _xfs_quota(path, "state -p")
    except (OSError, SharedVolumeError):
        return False
    return "Enforcement: ON" in out


def _fs_type(path: Path) -> int:
    """The filesystem magic of ``path`` (``statfs.f_type``; Python's ``statvfs`` lacks it)."""
    out = subprocess.run(["stat", "-f", "-c", "%t", os.fspath(path)], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return int(out.strip(), 16)


def _mountpoint(path: Path) -> str:
    out = subprocess.run(["findmnt", "-n", "-o", "TARGET", "--target", os.fspath(path)],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return out.strip().splitlines()[0]


def _xfs_quota(path: Path, command: str) -> str:
    try:
        done = subprocess.run([_XFS_QUOTA, "-x", "-c", command, _mountpoint(path)],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise SharedVolumeError(f"xfs_quota {command!r}: {e}") from e
    if done.returncode != 0:
        raise SharedVolumeError(f"xfs_quota {command!r}: {done.stderr.strip()[-300:]}")
    return done.stdout


def set_project_quota(root: Path, project: int, size_mb: int) -> None:
    """Make ``root`` project ``project`` (inherited by what is made under it) with a hard
    block limit of ``size_mb`` MiB."""
    _xfs_quota(root, f"project -s -p {os.fspath(root)} {project}")
    _xfs_quota(root, f"limit -p bhard={size_mb}m {project}")


def clear_project_quota(path: Path, project: int) -> None:
    _xfs_quota(path, f"limit -p bhard=0 bsoft=0 {project}")
