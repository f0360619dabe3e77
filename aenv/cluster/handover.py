"""Paused sandboxes that another node may resume: the handover files of the shared store.

When a node in a cluster with a shared store (``AENV_SHARED_STORE``) pauses a sandbox, it
publishes the pause's snapshot (``aenv.storage.shared_store``) and then *offers* the
sandbox: ``handover/<sandbox id>.json`` holds its record (paused, naming that snapshot) and
the snapshot's portability requirements.

Whoever resumes the sandbox first *claims* it: an atomic rename of that file (one directory,
one name: exactly one rename succeeds, on NFS and CephFS too). The node that paused it
claims it before its own resume; another node (sent by a gateway because the first one is
gone or full) claims it, inserts the record into its own store and resumes it from the
fetched snapshot. The loser of the race, and a node that comes back to find its paused
sandbox claimed (``moved``: its record names a snapshot that is published, and the offer
is gone or names another snapshot), drops its record: the sandbox lives elsewhere now.

A node that pauses a sandbox again offers it again, with the new snapshot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..storage import durable
from ..storage.image_ref import ImageRef
from ..storage.shared_store import SharedStore
from ..store import BuildStatus, SandboxRecord, SandboxState, TemplateKind, TemplateRecord

log = logging.getLogger("aenv.cluster")

HANDOVER = "handover"


@dataclasses.dataclass(frozen=True)
class Offer:
    record: SandboxRecord
    requires: dict[str, Any]
    node_id: str


class Handover:
    def __init__(self, store: SharedStore, node_id: str) -> None:
        self.store = store
        self.node_id = node_id

    @property
    def directory(self) -> Path:
        return self.store.root / HANDOVER

    def _path(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise ValueError(f"bad sandbox id {sandbox_id!r}")
        return self.directory / f"{sandbox_id}.json"

    def offer(self, rec: SandboxRecord, requires: dict[str, Any]) -> None:
        """Offer the paused ``rec`` (its ``snapshot_id`` published) to every node."""
        paused = dataclasses.replace(rec, state=SandboxState.PAUSED, vm_dir=None, vm_pid=None,
                                     slot=None, host_ip=None, restored_from=None, seq=0)
        data = {"record": _record_json(paused), "requires": requires, "node": self.node_id}
        path = self._path(rec.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{self.node_id}.{secrets.token_hex(6)}")
        durable.write_atomic(tmp, json.dumps(data).encode())
        os.replace(tmp, path)
        durable.fsync_dir(path.parent)

    def peek(self, sandbox_id: str) -> Offer | None:
        """The offer of ``sandbox_id``, without claiming it."""
        try:
            raw = self._path(sandbox_id).read_bytes()
        except (FileNotFoundError, ValueError):
            return None
        return _offer(raw)

    def claim(self, sandbox_id: str) -> Offer | None:
        """Take the offer of ``sandbox_id`` (None: there is none, or another node took it
        first)."""
        path = self._path(sandbox_id)
        taken = path.with_name(f".{path.name}.claimed.{self.node_id}.{secrets.token_hex(6)}")
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            return None
        try:
            return _offer(taken.read_bytes())
        finally:
            taken.unlink(missing_ok=True)
            durable.fsync_dir(path.parent)

    def put_back(self, offer: Offer) -> None:
        """Offer again what a claim took and could not resume."""
        self.offer(offer.record, offer.requires)

    def published(self, rec: SandboxRecord) -> bool:
        """Whether ``rec``'s pause snapshot is in the shared store."""
        sid = _snapshot_id(rec.snapshot_id)
        return sid is not None and self.store.has(sid)

    def moved(self, rec: SandboxRecord) -> bool:
        """Whether the paused ``rec`` was claimed by another node: its snapshot was
        published and offered, and the offer is gone or names another snapshot."""
        if rec.state != SandboxState.PAUSED or not self.published(rec):
            return False
        offer = self.peek(rec.id)
        return offer is None or offer.record.snapshot_id != rec.snapshot_id


def _snapshot_id(ref: str | None) -> str | None:
    if not ref:
        return None
    try:
        parsed = ImageRef.parse(ref)
    except ValueError:
        return None
    return parsed.id if parsed.is_snapshot else None


def _record_json(rec: SandboxRecord) -> dict[str, Any]:
    out = dataclasses.asdict(rec)
    out["state"] = str(rec.state.value)
    return out


def _offer(raw: bytes) -> Offer | None:
    try:
        data = json.loads(raw)
        fields = {f.name for f in dataclasses.fields(SandboxRecord)}
        rec = SandboxRecord(**{k: v for k, v in data["record"].items() if k in fields})
        rec.state = SandboxState(rec.state)
        return Offer(rec, dict(data.get("requires") or {}), str(data.get("node", "")))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("unreadable handover offer: %s", e)
        return None


# -- templates and persistent snapshots ----------------------------------------------------

TEMPLATES = "templates"


class SharedTemplates:
    """Template and persistent-snapshot records in the shared store, so that a node that
    does not know one (it was built or taken on another node) can start sandboxes from
    it: ``templates/<id>.json`` is the record (its image a published snapshot), and
    ``templates/ref/<quoted id or name>`` the id each of its names resolves to. Written
    like the rest of the store (temporary name, fsync, rename); the record first, so a
    name found always resolves."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store

    @property
    def directory(self) -> Path:
        return self.store.root / TEMPLATES

    def put(self, rec: TemplateRecord) -> None:
        data = dataclasses.asdict(rec)
        data["kind"], data["status"] = str(rec.kind.value), str(rec.status.value)
        data.update(last_spawned_at=None, spawn_count=0)
        _write(self.directory / f"{quote(rec.id, safe='')}.json", json.dumps(data).encode())
        for ref in (rec.id, *rec.names):
            _write(self.directory / "ref" / quote(ref, safe=""), rec.id.encode())

    def remove(self, rec: TemplateRecord) -> None:
        """Forget a deleted template: no node takes it from here any more (its snapshot's
        files stay, see ``shared_store``'s collection rule)."""
        for ref in (rec.id, *rec.names):
            path = self.directory / "ref" / quote(ref, safe="")
            with contextlib.suppress(OSError):
                if path.read_text().strip() == rec.id:
                    path.unlink()
        (self.directory / f"{quote(rec.id, safe='')}.json").unlink(missing_ok=True)

    def get(self, id_or_name: str) -> TemplateRecord | None:
        try:
            tid = (self.directory / "ref" / quote(id_or_name, safe="")).read_text().strip()
            data = json.loads((self.directory / f"{quote(tid, safe='')}.json").read_bytes())
            fields = {f.name for f in dataclasses.fields(TemplateRecord)}
            rec = TemplateRecord(**{k: v for k, v in data.items() if k in fields})
            rec.kind, rec.status = TemplateKind(rec.kind), BuildStatus(rec.status)
            return rec
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    durable.write_atomic(tmp, data)
    os.replace(tmp, path)
    durable.fsync_dir(path.parent)
