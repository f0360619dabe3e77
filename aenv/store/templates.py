"""Templates, their names (aliases), builds and build logs.

A persistent snapshot is stored as a template of kind ``snapshot``: E2B's API uses one
catalogue for both (a snapshot id is accepted wherever a template id is, and
``DELETE /templates/{id}`` removes either).
"""

from __future__ import annotations

import time
from typing import Any

from .db import Database
from .records import BuildRecord, TemplateRecord, encode_changes, from_row, to_columns


class NameTaken(Exception):
    def __init__(self, name: str, owner: str) -> None:
        super().__init__(f"name '{name}' is already used by template {owner}")
        self.name, self.owner = name, owner


class TemplateStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # -- templates ------------------------------------------------------------------------

    def insert(self, rec: TemplateRecord) -> TemplateRecord:
        cols = to_columns(rec, skip=("names",))
        with self.db.write() as c:
            c.execute(
                f"INSERT INTO templates ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                tuple(cols.values()),
            )
            for name in rec.names:
                self._claim_name(c, name, rec.id)
        return rec

    def _claim_name(self, c, name: str, template_id: str) -> None:
        row = c.execute("SELECT template_id FROM template_names WHERE name = ?", (name,)).fetchone()
        if row and row[0] != template_id:
            raise NameTaken(name, row[0])
        c.execute("INSERT OR IGNORE INTO template_names (name, template_id) VALUES (?, ?)",
                  (name, template_id))

    def add_name(self, template_id: str, name: str) -> None:
        with self.db.write() as c:
            self._claim_name(c, name, template_id)

    def get(self, id_or_name: str) -> TemplateRecord | None:
        """By id, else by name (alias)."""
        rows = self.db.query("SELECT * FROM templates WHERE id = ?", (id_or_name,))
        if not rows:
            rows = self.db.query(
                "SELECT t.* FROM templates t JOIN template_names n ON n.template_id = t.id "
                "WHERE n.name = ?",
                (id_or_name,),
            )
        return self._with_names(rows[0]) if rows else None

    def template_id_for_name(self, name: str) -> str | None:
        rows = self.db.query("SELECT template_id FROM template_names WHERE name = ?", (name,))
        return rows[0][0] if rows else None

    def _with_names(self, row) -> TemplateRecord:
        names = [r[0] for r in self.db.query(
            "SELECT name FROM template_names WHERE template_id = ? ORDER BY name", (row["id"],))]
        return from_row(TemplateRecord, row, names=names)

    def list(self, kind: str | None = None, source_sandbox: str | None = None,
             name: str | None = None) -> list[TemplateRecord]:
        sql, params = "SELECT * FROM templates WHERE 1=1", []
        if kind:
            sql += " AND kind = ?"
            params.append(kind)
        if source_sandbox:
            sql += " AND source_sandbox = ?"
            params.append(source_sandbox)
        if name:
            sql += " AND id IN (SELECT template_id FROM template_names WHERE name = ?)"
            params.append(name)
        sql += " ORDER BY created_at DESC, id"
        return [self._with_names(r) for r in self.db.query(sql, tuple(params))]

    def update(self, template_id: str, **changes: Any) -> None:
        changes.setdefault("updated_at", time.time())
        cols = encode_changes(changes)
        with self.db.transaction() as c:
            c.execute(f"UPDATE templates SET {','.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                      (*cols.values(), template_id))

    def delete(self, template_id: str) -> bool:
        with self.db.write() as c:
            return c.execute("DELETE FROM templates WHERE id = ?", (template_id,)).rowcount == 1

    def children(self, template_id: str) -> list[str]:
        return [r[0] for r in self.db.query(
            "SELECT id FROM templates WHERE parent_id = ?", (template_id,))]

    # -- builds ---------------------------------------------------------------------------

    def insert_build(self, rec: BuildRecord) -> None:
        cols = to_columns(rec)
        with self.db.write() as c:
            c.execute(f"INSERT INTO builds ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                      tuple(cols.values()))

    def get_build(self, build_id: str) -> BuildRecord | None:
        rows = self.db.query("SELECT * FROM builds WHERE id = ?", (build_id,))
        return from_row(BuildRecord, rows[0]) if rows else None

    def builds_in(self, statuses: tuple[str, ...]) -> list[BuildRecord]:
        rows = self.db.query(
            f"SELECT * FROM builds WHERE status IN ({','.join('?' * len(statuses))})", statuses)
        return [from_row(BuildRecord, r) for r in rows]

    def update_build(self, build_id: str, **changes: Any) -> None:
        cols = encode_changes(changes)
        with self.db.transaction() as c:
            c.execute(f"UPDATE builds SET {','.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                      (*cols.values(), build_id))

    def append_log(self, build_id: str, message: str, level: str = "info",
                   step: str | None = None) -> None:
        with self.db.write() as c:
            seq = c.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM build_logs WHERE build_id = ?",
                            (build_id,)).fetchone()[0]
            c.execute("INSERT INTO build_logs VALUES (?, ?, ?, ?, ?, ?)",
                      (build_id, seq, time.time(), level, step, message))

    def logs(self, build_id: str, offset: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.db.query(
            "SELECT seq, ts, level, step, message FROM build_logs WHERE build_id = ? AND seq >= ? "
            "ORDER BY seq LIMIT ?", (build_id, offset, limit))
        return [dict(r) for r in rows]
