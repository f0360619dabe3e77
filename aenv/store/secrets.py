"""Secrets (E2B ``Secret``): named values with versions, sealed at rest by ``SecretBox``.

A secret has an id (``sec_`` + 20 random characters), a unique lower-case name, metadata
and a list of versions; the newest is current. Values go in sealed and come out only
through ``value`` (the egress proxy's header transforms); the API never reads them.
Deleting a secret deletes every version.

``Secrets`` is what the API and the egress proxy use, awaited: this node's store
(``LocalSecrets`` over ``SecretStore``) or, in a cluster, the cluster's shared one
(``aenv.cluster.shared_secrets``), which raises ``SecretsUnavailable`` while it cannot be
reached.

The two tables are created here (``CREATE TABLE IF NOT EXISTS``) rather than as a
numbered migration of ``db.py``: they share nothing with the other tables, and so the
order in which features add migrations cannot matter to them.
"""

from __future__ import annotations

import json
import secrets as _random
import sqlite3
import string
import time
from dataclasses import dataclass, field
from typing import Protocol

from .db import Database
from .secret_box import SecretBox

_SCHEMA = """
CREATE TABLE IF NOT EXISTS secrets (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    metadata    TEXT NOT NULL DEFAULT '{}',
    version     INTEGER NOT NULL,
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS secret_versions (
    secret_id   TEXT NOT NULL REFERENCES secrets(id) ON DELETE CASCADE,
    version     INTEGER NOT NULL,
    sealed      BLOB NOT NULL,
    created_at  REAL NOT NULL,
    PRIMARY KEY (secret_id, version)
);
"""

ID_PREFIX = "sec_"
_ID_CHARS = string.ascii_lowercase + string.digits


class SecretsUnavailable(Exception):
    """The store that holds the secrets cannot be reached now (a cluster's Redis)."""


class SecretNameTaken(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"a secret named '{name}' already exists")
        self.name = name


@dataclass
class SecretRecord:
    id: str
    name: str
    version: int
    created_at: float
    updated_at: float
    metadata: dict[str, str] = field(default_factory=dict)


def _record(row: sqlite3.Row) -> SecretRecord:
    return SecretRecord(id=row["id"], name=row["name"], version=row["version"],
                        created_at=row["created_at"], updated_at=row["updated_at"],
                        metadata=json.loads(row["metadata"]))


def _context(secret_id: str, version: int) -> str:
    return f"{secret_id}:{version}"


class SecretStore:
    def __init__(self, db: Database, box: SecretBox) -> None:
        self.db, self._box = db, box
        with db.transaction() as c:
            c.executescript(_SCHEMA)

    def create(self, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        """A new secret at version 1; ``SecretNameTaken`` when the name is in use."""
        now = time.time()
        rec = SecretRecord(id=ID_PREFIX + "".join(_random.choice(_ID_CHARS) for _ in range(20)),
                           name=name, version=1, created_at=now, updated_at=now,
                           metadata=dict(metadata))
        try:
            with self.db.write() as c:
                c.execute("INSERT INTO secrets (id, name, metadata, version, created_at, "
                          "updated_at) VALUES (?, ?, ?, 1, ?, ?)",
                          (rec.id, name, json.dumps(rec.metadata), now, now))
                c.execute("INSERT INTO secret_versions VALUES (?, 1, ?, ?)",
                          (rec.id, self._box.seal(value, _context(rec.id, 1)), now))
        except sqlite3.IntegrityError:
            raise SecretNameTaken(name) from None
        return rec

    def get(self, id_or_name: str) -> SecretRecord | None:
        """By id, else by name (names are stored lower-case)."""
        rows = self.db.query("SELECT * FROM secrets WHERE id = ? OR name = ? "
                             "ORDER BY id = ? DESC LIMIT 1",
                             (id_or_name, id_or_name.lower(), id_or_name))
        return _record(rows[0]) if rows else None

    def update(self, id_or_name: str, value: str,
               metadata: dict[str, str] | None) -> SecretRecord | None:
        """Add a version holding ``value``; a given ``metadata`` replaces the stored one."""
        with self.db.write() as c:
            rows = c.execute("SELECT * FROM secrets WHERE id = ? OR name = ? "
                             "ORDER BY id = ? DESC LIMIT 1",
                             (id_or_name, id_or_name.lower(), id_or_name)).fetchall()
            if not rows:
                return None
            rec = _record(rows[0])
            rec.version += 1
            rec.updated_at = time.time()
            if metadata is not None:
                rec.metadata = dict(metadata)
            c.execute("INSERT INTO secret_versions VALUES (?, ?, ?, ?)",
                      (rec.id, rec.version,
                       self._box.seal(value, _context(rec.id, rec.version)), rec.updated_at))
            c.execute("UPDATE secrets SET version = ?, updated_at = ?, metadata = ? "
                      "WHERE id = ?",
                      (rec.version, rec.updated_at, json.dumps(rec.metadata), rec.id))
        return rec

    def delete(self, id_or_name: str) -> bool:
        rec = self.get(id_or_name)
        if rec is None:
            return False
        with self.db.write() as c:
            c.execute("DELETE FROM secret_versions WHERE secret_id = ?", (rec.id,))
            c.execute("DELETE FROM secrets WHERE id = ?", (rec.id,))
        return True

    def page(self, after: tuple[float, str] | None, limit: int) -> list[SecretRecord]:
        """Up to ``limit`` secrets in (created_at, id) order after the cursor ``after``."""
        if after is None:
            rows = self.db.query("SELECT * FROM secrets ORDER BY created_at, id LIMIT ?",
                                 (limit,))
        else:
            rows = self.db.query(
                "SELECT * FROM secrets WHERE (created_at, id) > (?, ?) "
                "ORDER BY created_at, id LIMIT ?", (after[0], after[1], limit))
        return [_record(r) for r in rows]

    def value(self, name: str) -> str | None:
        """The current value of the secret named ``name`` (for egress transforms only)."""
        rows = self.db.query(
            "SELECT s.id AS id, v.version AS version, v.sealed AS sealed FROM secrets s "
            "JOIN secret_versions v ON v.secret_id = s.id AND v.version = s.version "
            "WHERE s.name = ?", (name.lower(),))
        if not rows:
            return None
        return self._box.open(rows[0]["sealed"], _context(rows[0]["id"], rows[0]["version"]))


class Secrets(Protocol):
    """Secrets as the API and the egress proxy use them (see the module docstring)."""

    async def create(self, name: str, value: str,
                     metadata: dict[str, str]) -> SecretRecord: ...

    async def get(self, id_or_name: str) -> SecretRecord | None: ...

    async def update(self, id_or_name: str, value: str,
                     metadata: dict[str, str] | None) -> SecretRecord | None: ...

    async def delete(self, id_or_name: str) -> bool: ...

    async def page(self, after: tuple[float, str] | None,
                   limit: int) -> list[SecretRecord]: ...

    async def value(self, name: str) -> str | None: ...


class LocalSecrets:
    """``SecretStore`` as ``Secrets``: this node's database, read and written inline (one
    SQLite statement or two, as every other store call of the API)."""

    def __init__(self, store: SecretStore) -> None:
        self.store = store

    async def create(self, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        return self.store.create(name, value, metadata)

    async def get(self, id_or_name: str) -> SecretRecord | None:
        return self.store.get(id_or_name)

    async def update(self, id_or_name: str, value: str,
                     metadata: dict[str, str] | None) -> SecretRecord | None:
        return self.store.update(id_or_name, value, metadata)

    async def delete(self, id_or_name: str) -> bool:
        return self.store.delete(id_or_name)

    async def page(self, after: tuple[float, str] | None, limit: int) -> list[SecretRecord]:
        return self.store.page(after, limit)

    async def value(self, name: str) -> str | None:
        return self.store.value(name)
