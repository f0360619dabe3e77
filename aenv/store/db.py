"""The SQLite connection and its schema migrations.

One connection per process, shared by threads under a lock: every statement here takes
well under a millisecond, so the event loop calls it directly instead of paying a thread
hop. WAL with ``synchronous=NORMAL`` keeps every committed transaction across a crash of
the process (``kill -9``); only a power loss can drop the last few.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_MIGRATIONS: list[str] = [
    # 1: first schema
    """
    CREATE TABLE sandboxes (
        id              TEXT PRIMARY KEY,
        seq             INTEGER NOT NULL,
        template_id     TEXT NOT NULL,
        alias           TEXT,
        state           TEXT NOT NULL,
        client_id       TEXT NOT NULL,
        started_at      REAL NOT NULL,
        end_at          REAL NOT NULL,
        ended_at        REAL,
        cpu_count       INTEGER NOT NULL,
        memory_mb       INTEGER NOT NULL,
        disk_size_mb    INTEGER NOT NULL,
        metadata        TEXT NOT NULL DEFAULT '{}',
        env_vars        TEXT NOT NULL DEFAULT '{}',
        envd_token      TEXT,
        traffic_token   TEXT,
        secure          INTEGER NOT NULL DEFAULT 1,
        auto_pause      INTEGER NOT NULL DEFAULT 0,
        auto_pause_memory INTEGER NOT NULL DEFAULT 1,
        auto_resume     INTEGER NOT NULL DEFAULT 0,
        allow_internet  INTEGER,
        network         TEXT,
        pause_mode      TEXT,
        runtime         TEXT,
        vm_dir          TEXT,
        vm_pid          INTEGER,
        slot            INTEGER,
        host_ip         TEXT,
        snapshot_id     TEXT,
        idempotency_key TEXT,
        reason          TEXT
    );
    CREATE UNIQUE INDEX sandboxes_seq ON sandboxes(seq);
    CREATE INDEX sandboxes_state ON sandboxes(state);
    CREATE UNIQUE INDEX sandboxes_idem ON sandboxes(idempotency_key)
        WHERE idempotency_key IS NOT NULL;

    CREATE TABLE templates (
        id              TEXT PRIMARY KEY,
        kind            TEXT NOT NULL,          -- 'template' | 'snapshot'
        build_id        TEXT NOT NULL,
        status          TEXT NOT NULL,          -- waiting | building | ready | error
        cpu_count       INTEGER NOT NULL,
        memory_mb       INTEGER NOT NULL,
        disk_size_mb    INTEGER NOT NULL,
        public          INTEGER NOT NULL DEFAULT 0,
        image           TEXT,                   -- content address of the root image
        parent_id       TEXT,
        source_sandbox  TEXT,
        start_cmd       TEXT,
        ready_cmd       TEXT,
        env_vars        TEXT NOT NULL DEFAULT '{}',
        workdir         TEXT,
        user            TEXT,
        created_at      REAL NOT NULL,
        updated_at      REAL NOT NULL,
        last_spawned_at REAL,
        spawn_count     INTEGER NOT NULL DEFAULT 0,
        build_count     INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE template_names (
        name            TEXT PRIMARY KEY,
        template_id     TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE
    );
    CREATE INDEX template_names_tid ON template_names(template_id);

    CREATE TABLE builds (
        id              TEXT PRIMARY KEY,
        template_id     TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
        status          TEXT NOT NULL,
        spec            TEXT,
        reason          TEXT,
        reason_step     TEXT,
        created_at      REAL NOT NULL,
        finished_at     REAL
    );
    CREATE TABLE build_logs (
        build_id        TEXT NOT NULL REFERENCES builds(id) ON DELETE CASCADE,
        seq             INTEGER NOT NULL,
        ts              REAL NOT NULL,
        level           TEXT NOT NULL,
        step            TEXT,
        message         TEXT NOT NULL,
        PRIMARY KEY (build_id, seq)
    );
    """,
    # 2: snapshots — what a running sandbox was restored from (keeps that snapshot alive),
    # and the envd token a template's or snapshot's memory image carries.
    """
    ALTER TABLE sandboxes ADD COLUMN restored_from TEXT;
    ALTER TABLE templates ADD COLUMN envd_token TEXT;
    """,
    # 3: template tags (E2B's tag assignments). A tag names one build of its template;
    # a build keeps what the template was when it became ready (``outcome``), so a tag can
    # go on naming it after a newer build. ``tags`` are what a build gets once ready.
    # Names with a tag (``x:t`` beside ``x``) were how tags were kept: each becomes a tag
    # of its template's current build, and stops being a name.
    """
    ALTER TABLE builds ADD COLUMN tags TEXT;
    ALTER TABLE builds ADD COLUMN outcome TEXT;
    CREATE TABLE template_tags (
        template_id     TEXT NOT NULL REFERENCES templates(id) ON DELETE CASCADE,
        tag             TEXT NOT NULL,
        build_id        TEXT NOT NULL,
        created_at      REAL NOT NULL,
        PRIMARY KEY (template_id, tag)
    );
    CREATE TEMP TABLE tag_names AS
        SELECT n.name AS name, n.template_id AS template_id,
               lower(substr(n.name, instr(n.name, ':') + 1)) AS tag,
               t.build_id AS build_id, t.updated_at AS created_at
        FROM template_names n JOIN templates t ON t.id = n.template_id
        WHERE t.kind = 'template' AND t.status = 'ready' AND instr(n.name, ':') > 1
          AND (substr(n.name, 1, instr(n.name, ':') - 1) = t.id
               OR substr(n.name, 1, instr(n.name, ':') - 1) IN
                  (SELECT name FROM template_names WHERE template_id = t.id));
    INSERT OR IGNORE INTO template_tags (template_id, tag, build_id, created_at)
        SELECT template_id, tag, build_id, created_at FROM tag_names WHERE tag != '';
    DELETE FROM template_names WHERE name IN (SELECT name FROM tag_names);
    DROP TABLE tag_names;
    """,
    # 4: the volumes a sandbox mounts, [{name, path, volumeID}] as JSON (store/volumes.py).
    """
    ALTER TABLE sandboxes ADD COLUMN volume_mounts TEXT;
    """,
]


class Database:
    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=10.0
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        with self.transaction() as c:
            version = c.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(_MIGRATIONS[version:], start=version + 1):
                c.executescript(f"BEGIN; {script}; PRAGMA user_version={i}; COMMIT;")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection, held exclusively; statements inside run in one transaction
        when the caller issues BEGIN (``write``) or autocommit otherwise."""
        with self._lock:
            yield self._conn

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """An immediate write transaction: committed on success, rolled back on error."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def query(self, sql: str,
              params: tuple[Any, ...] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
