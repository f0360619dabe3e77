"""Templates, their names (aliases), builds and build logs.

A persistent snapshot is stored as a template of kind ``snapshot``: E2B's API uses one
catalogue for both (a snapshot id is accepted wherever a template id is, and
``DELETE /templates/{id}`` removes either).

A build's log is bounded (``LogLimits``): lines longer than ``line_bytes`` are cut, the
first ``head_*`` lines are shown as they are written, and past them only the newest
``tail_*`` lines are kept — held back, with a notice, until the build ends (its status
becomes ``ready`` or ``error``), then shown after a marker saying how many were dropped.
Shown lines are numbered 0, 1, 2, ... and never renumbered or removed, because the E2B SDK
polls with ``logsOffset`` = the number of entries it has received: a rolling tail that
dropped lines already numbered would make a client that fell behind read lines twice or
loop. Held lines live in ``build_logs`` with a negative ``seq`` (``_HELD + n``), which no
offset reaches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from .db import Database
from .records import BuildRecord, TemplateRecord, encode_changes, from_row, to_columns

_HELD = -(1 << 62)  # seq of the first held-back line; the n-th is _HELD + n
_ENDED = ("ready", "error")
_BYTES = "length(CAST(message AS BLOB))"


@dataclass(frozen=True)
class LogLimits:
    """How much of one build's output is stored (bytes are UTF-8)."""

    line_bytes: int = 8 * 1024  # a longer line is cut, and says by how much
    head_lines: int = 5_000  # shown as written ...
    head_bytes: int = 1 << 20
    tail_lines: int = 5_000  # ... then the newest lines past the head, shown at the end
    tail_bytes: int = 1 << 20


@dataclass(frozen=True)
class _Tally:
    """Where a running build's log stands; rebuilt from the table when it disagrees."""

    shown: int  # shown lines (the next one gets this seq)
    shown_bytes: int
    held_first: int  # n of the oldest held line kept (held lines are _HELD + n)
    held_next: int  # n the next held line gets
    held_bytes: int

    @property
    def holding(self) -> bool:
        return self.held_next > 0


def _cut(message: str, limit: int) -> str:
    raw = message.encode("utf-8", "replace")
    if len(raw) <= limit:
        return message
    note = " ... [{} bytes cut]"
    keep = max(0, limit - len(note.format(len(raw))))
    head = raw[:keep].decode("utf-8", "ignore")
    return head + note.format(len(raw) - len(head.encode()))


class NameTaken(Exception):
    def __init__(self, name: str, owner: str) -> None:
        super().__init__(f"name '{name}' is already used by template {owner}")
        self.name, self.owner = name, owner


class TemplateStore:
    def __init__(self, db: Database, log_limits: LogLimits = LogLimits()) -> None:
        self.db = db
        self.log_limits = log_limits
        self._tallies: dict[str, _Tally] = {}  # builds whose log is being written

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
        """When the build ends, its held-back log tail is shown in the same transaction,
        so a client that sees the final status also finds the last lines."""
        cols = encode_changes(changes)
        with self.db.write() as c:
            if changes.get("status") in _ENDED:
                self._show_held(c, build_id)
            c.execute(f"UPDATE builds SET {','.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                      (*cols.values(), build_id))
        if changes.get("status") in _ENDED:
            self._tallies.pop(build_id, None)

    # -- build logs -----------------------------------------------------------------------

    def append_log(self, build_id: str, message: str, level: str = "info",
                   step: str | None = None) -> None:
        lim = self.log_limits
        message = _cut(message, lim.line_bytes)
        size = len(message.encode("utf-8", "replace"))
        with self.db.write() as c:
            status, top, held_top = c.execute(
                "SELECT (SELECT status FROM builds WHERE id = ?1), "
                "(SELECT MAX(seq) FROM build_logs WHERE build_id = ?1 AND seq >= 0), "
                "(SELECT MAX(seq) FROM build_logs WHERE build_id = ?1 AND seq < 0)",
                (build_id,)).fetchone()
            shown = 0 if top is None else top + 1
            if status in _ENDED:
                # A line or two after the end ("build finished"): shown, within a margin.
                if shown < lim.head_lines + lim.tail_lines + 16:
                    self._insert(c, build_id, shown, level, step, message)
                return
            t = self._tally(c, build_id, shown, 0 if held_top is None else held_top - _HELD + 1)
            if not t.holding and t.shown < lim.head_lines \
                    and t.shown_bytes + size <= lim.head_bytes:
                self._insert(c, build_id, t.shown, level, step, message)
                t = replace(t, shown=t.shown + 1, shown_bytes=t.shown_bytes + size)
            else:
                if not t.holding:
                    self._insert(c, build_id, t.shown, "warn", step,
                                 f"[aenv] the build's output is over {lim.head_lines} lines "
                                 f"or {lim.head_bytes // 1024} KiB: only its last "
                                 f"{lim.tail_lines} lines are kept, shown when the build ends")
                    t = replace(t, shown=t.shown + 1)
                self._insert(c, build_id, _HELD + t.held_next, level, step, message)
                t = replace(t, held_next=t.held_next + 1, held_bytes=t.held_bytes + size)
                while t.held_next - t.held_first > 1 and (
                        t.held_next - t.held_first > lim.tail_lines
                        or t.held_bytes > lim.tail_bytes):
                    (gone,) = c.execute(
                        f"DELETE FROM build_logs WHERE build_id = ? AND seq = ? "
                        f"RETURNING {_BYTES}", (build_id, _HELD + t.held_first)).fetchone()
                    t = replace(t, held_first=t.held_first + 1, held_bytes=t.held_bytes - gone)
        self._tallies[build_id] = t

    def logs(self, build_id: str, offset: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """Shown lines from ``offset`` (their ``seq``) on; held-back lines are not shown."""
        rows = self.db.query(
            "SELECT seq, ts, level, step, message FROM build_logs WHERE build_id = ? AND seq >= ? "
            "ORDER BY seq LIMIT ?", (build_id, max(0, offset), limit))
        return [dict(r) for r in rows]

    @staticmethod
    def _insert(c, build_id: str, seq: int, level: str, step: str | None, message: str,
                ts: float | None = None) -> None:
        c.execute("INSERT INTO build_logs VALUES (?, ?, ?, ?, ?, ?)",
                  (build_id, seq, time.time() if ts is None else ts, level, step, message))

    @staticmethod
    def _shown(c, build_id: str) -> int:
        return c.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM build_logs "
                         "WHERE build_id = ? AND seq >= 0", (build_id,)).fetchone()[0]

    def _tally(self, c, build_id: str, shown: int, held_next: int) -> _Tally:
        """The cached tally when the table agrees with it (its top seqs, read by the caller),
        else one read of the build's rows: after a restart, or if anything else wrote them."""
        t = self._tallies.get(build_id)
        if t is not None and t.shown == shown and t.held_next == held_next:
            return t
        shown, shown_bytes = c.execute(
            f"SELECT COUNT(*), COALESCE(SUM({_BYTES}), 0) FROM build_logs "
            "WHERE build_id = ? AND seq >= 0", (build_id,)).fetchone()
        lo, hi, held_bytes = c.execute(
            f"SELECT MIN(seq), MAX(seq), COALESCE(SUM({_BYTES}), 0) FROM build_logs "
            "WHERE build_id = ? AND seq < 0", (build_id,)).fetchone()
        if lo is None:
            return _Tally(shown, shown_bytes, 0, 0, 0)
        return _Tally(shown, shown_bytes, lo - _HELD, hi - _HELD + 1, held_bytes)

    def _show_held(self, c, build_id: str) -> None:
        """Number the held-back lines after the shown ones, behind a marker line."""
        lo, n, ts, step = c.execute(
            "SELECT MIN(seq), COUNT(*), MIN(ts), "
            "(SELECT step FROM build_logs WHERE build_id = ?1 AND seq < 0 ORDER BY seq LIMIT 1) "
            "FROM build_logs WHERE build_id = ?1 AND seq < 0", (build_id,)).fetchone()
        if not n:
            return
        dropped = lo - _HELD
        shown = self._shown(c, build_id)
        self._insert(c, build_id, shown, "warn", step,
                     f"[aenv] {dropped} lines of output were dropped; the last {n} follow"
                     if dropped else f"[aenv] the {n} held-back lines follow", ts=ts)
        c.execute("UPDATE build_logs SET seq = seq - ? WHERE build_id = ? AND seq < 0",
                  (lo - (shown + 1), build_id))
