"""Volumes (E2B ``Volume``): id, unique name, size, and the bearer token of the content API.

The token is kept as issued, like the API key (E2B's ``GET /volumes/{id}`` answers with it
too, so it cannot be a one-way hash); comparisons are constant-time.

The table is created here (``CREATE TABLE IF NOT EXISTS``) rather than as a numbered
migration of ``db.py``: it shares nothing with the other tables, so the order in which
features add migrations cannot matter to it. Which sandboxes mount a volume is kept on the
sandbox (``SandboxRecord.volume_mounts``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import string
import time
from dataclasses import dataclass

from .db import Database

_SCHEMA = """
CREATE TABLE IF NOT EXISTS volumes (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    token       TEXT NOT NULL,
    size_mb     INTEGER NOT NULL,
    state       TEXT NOT NULL,      -- 'creating' | 'ready'
    created_at  REAL NOT NULL
);
"""

ID_PREFIX = "vol_"
_ID_CHARS = string.ascii_lowercase + string.digits


class VolumeNameTaken(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"a volume named '{name}' already exists")
        self.name = name


@dataclass
class VolumeRecord:
    id: str
    name: str
    token: str
    size_mb: int
    state: str
    created_at: float

    def token_matches(self, given: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                   hashlib.sha256(self.token.encode()).digest())


def _record(row: sqlite3.Row) -> VolumeRecord:
    return VolumeRecord(id=row["id"], name=row["name"], token=row["token"],
                        size_mb=row["size_mb"], state=row["state"],
                        created_at=row["created_at"])


def new_volume_id() -> str:
    return ID_PREFIX + "".join(secrets.choice(_ID_CHARS) for _ in range(20))


class VolumeStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        with db.transaction() as c:
            c.executescript(_SCHEMA)

    def insert(self, name: str, size_mb: int) -> VolumeRecord:
        """A new volume in state ``creating``; ``VolumeNameTaken`` when the name is used."""
        rec = VolumeRecord(id=new_volume_id(), name=name, token=secrets.token_urlsafe(32),
                           size_mb=size_mb, state="creating", created_at=time.time())
        try:
            with self.db.write() as c:
                c.execute("INSERT INTO volumes VALUES (?, ?, ?, ?, ?, ?)",
                          (rec.id, rec.name, rec.token, rec.size_mb, rec.state,
                           rec.created_at))
        except sqlite3.IntegrityError:
            raise VolumeNameTaken(name) from None
        return rec

    def set_ready(self, volume_id: str) -> None:
        with self.db.write() as c:
            c.execute("UPDATE volumes SET state = 'ready' WHERE id = ?", (volume_id,))

    def get(self, volume_id: str) -> VolumeRecord | None:
        rows = self.db.query("SELECT * FROM volumes WHERE id = ?", (volume_id,))
        return _record(rows[0]) if rows else None

    def by_name(self, name: str) -> VolumeRecord | None:
        rows = self.db.query("SELECT * FROM volumes WHERE name = ?", (name,))
        return _record(rows[0]) if rows else None

    def list(self) -> list[VolumeRecord]:
        return [_record(r) for r in
                self.db.query("SELECT * FROM volumes ORDER BY created_at, id")]

    def delete(self, volume_id: str) -> bool:
        with self.db.write() as c:
            return c.execute("DELETE FROM volumes WHERE id = ?", (volume_id,)).rowcount > 0
