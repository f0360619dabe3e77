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

Tags (E2B's ``name:tag``): a tag names one build of its template, and a reference to a
template is resolved to a build by ``get``: ``x:t`` is the build tag ``t`` names (or the
build whose id is ``t``), and ``x`` alone, like the template's id, means ``x:default``.
A template on which no build carries ``default`` (the built-in ``base``, snapshots, one
built only as ``x:v1``) has an implicit one: its latest build. A build's tags (``
set_build_tags``, else the tags of its spec's names) move to it when it is marked ready,
so a rebuild takes over the tags it was built with and the others keep their builds; and
what the template record then says (image, start command, env...) is kept as the build's
outcome: that is what a tag naming an older build resolves to. This relies on the
builder naming the build in the template record (``update(build_id=...)``) before it
marks the build ready. A name with a tag (``x:t`` where ``x`` is the same template) is a
tag, not a name: ``add_name`` leaves it to the tags. Deleting a template deletes its tags.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from dataclasses import dataclass, replace
from typing import Any

from .db import Database
from .records import BuildRecord, TemplateRecord, encode_changes, from_row, to_columns
from .states import BUILD_ENDED, BuildStatus, TemplateKind

_HELD = -(1 << 62)  # seq of the first held-back line; the n-th is _HELD + n
_BYTES = "length(CAST(message AS BLOB))"
DEFAULT_TAG = "default"
# What a build decides about its template: kept per build, what an older tag resolves to.
_OUTCOME = ("build_id", "image", "parent_id", "env_vars", "workdir", "user", "start_cmd",
            "ready_cmd", "envd_token")


@dataclass(frozen=True)
class TemplateTag:
    """One tag of a template: the build it names, since when."""

    tag: str
    build_id: str
    created_at: float


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
            for name in sorted(rec.names, key=lambda n: ":" in n):  # names before tags
                self._claim_name(c, name, rec.id, rec.kind)
        return rec

    def _claim_name(self, c: sqlite3.Connection, name: str, template_id: str,
                    kind: TemplateKind | None) -> None:
        base, sep, _ = name.partition(":")
        if sep and base and kind == TemplateKind.TEMPLATE and (base == template_id or c.execute(
                "SELECT 1 FROM template_names WHERE name = ? AND template_id = ?",
                (base, template_id)).fetchone()):
            return  # a tag of this template: its builds carry it (template_tags)
        row = c.execute("SELECT template_id FROM template_names WHERE name = ?", (name,)).fetchone()
        if row and row[0] != template_id:
            raise NameTaken(name, row[0])
        c.execute("INSERT OR IGNORE INTO template_names (name, template_id) VALUES (?, ?)",
                  (name, template_id))

    def add_name(self, template_id: str, name: str) -> None:
        with self.db.write() as c:
            kind = c.execute("SELECT kind FROM templates WHERE id = ?", (template_id,)).fetchone()
            self._claim_name(c, name, template_id, kind[0] if kind else None)

    def get(self, ref: str) -> TemplateRecord | None:
        """What ``ref`` names: an id or a name (alias), either with an optional ``:tag``,
        as of the build it resolves to (the module docstring says which). A template whose
        first build is not ready yet is returned as it is (its ``status`` says so)."""
        row = self._row(ref)
        if row is not None:
            rec = self._with_names(row)
            # A name holding a ':' is a snapshot's (``<id>:default``): no tags there.
            return rec if ":" in ref else self._at_tag(rec, DEFAULT_TAG)
        base, sep, tag = ref.partition(":")
        if not (sep and base):
            return None
        row = self._row(base)
        return self._at_tag(self._with_names(row), tag) if row is not None else None

    def _row(self, id_or_name: str) -> sqlite3.Row | None:
        rows = self.db.query("SELECT * FROM templates WHERE id = ?", (id_or_name,))
        if not rows:
            rows = self.db.query(
                "SELECT t.* FROM templates t JOIN template_names n ON n.template_id = t.id "
                "WHERE n.name = ?",
                (id_or_name,),
            )
        return rows[0] if rows else None

    def template_id_for_name(self, name: str) -> str | None:
        rows = self.db.query("SELECT template_id FROM template_names WHERE name = ?", (name,))
        return rows[0][0] if rows else None

    def _at_tag(self, rec: TemplateRecord, tag: str) -> TemplateRecord | None:
        found = self._build_for(rec, tag)
        if found is None:
            return rec if tag.strip().lower() == DEFAULT_TAG else None
        _, outcome = found
        return rec if outcome is None else replace(rec, **outcome)

    def _build_for(self, rec: TemplateRecord, tag: str
                   ) -> tuple[str, dict[str, Any] | None] | None:
        """The build ``tag`` (or a build id) names on ``rec``, with its outcome (None when
        it is the template's current build); None when it names none that is ready."""
        key = tag.strip().lower()
        rows = self.db.query("SELECT build_id FROM template_tags WHERE template_id = ? "
                             "AND tag = ?", (rec.id, key))
        build_id = rows[0][0] if rows else rec.build_id if key == DEFAULT_TAG else tag
        if build_id and build_id == rec.build_id:
            return build_id, None
        rows = self.db.query("SELECT outcome FROM builds WHERE id = ? AND template_id = ? "
                             "AND status = ? AND outcome IS NOT NULL",
                             (build_id, rec.id, BuildStatus.READY))
        if rows:
            return build_id, json.loads(rows[0][0])
        if key == DEFAULT_TAG and rec.build_id:
            return rec.build_id, None  # its build is gone: the implicit default
        return None

    def _with_names(self, row: sqlite3.Row) -> TemplateRecord:
        names = [r[0] for r in self.db.query(
            "SELECT name FROM template_names WHERE template_id = ? ORDER BY name", (row["id"],))]
        return from_row(TemplateRecord, row, names=names)

    def list(self, kind: TemplateKind | None = None, source_sandbox: str | None = None,
             name: str | None = None) -> list[TemplateRecord]:
        sql, params = "SELECT * FROM templates WHERE 1=1", builtins.list[str]()
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

    def children(self, template_id: str) -> builtins.list[str]:
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

    def builds_in(self, statuses: tuple[BuildStatus, ...]) -> builtins.list[BuildRecord]:
        rows = self.db.query(
            f"SELECT * FROM builds WHERE status IN ({','.join('?' * len(statuses))})", statuses)
        return [from_row(BuildRecord, r) for r in rows]

    def update_build(self, build_id: str, **changes: Any) -> None:
        """When the build ends, its held-back log tail is shown in the same transaction,
        so a client that sees the final status also finds the last lines."""
        cols = encode_changes(changes)
        with self.db.write() as c:
            if changes.get("status") in BUILD_ENDED:
                self._show_held(c, build_id)
            c.execute(f"UPDATE builds SET {','.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                      (*cols.values(), build_id))
            if changes.get("status") == BuildStatus.READY:
                self._tag_ready_build(c, build_id)
        if changes.get("status") in BUILD_ENDED:
            self._tallies.pop(build_id, None)

    def set_build_tags(self, build_id: str, tags: builtins.list[str]) -> None:
        """The tags ``build_id`` takes over once it is ready (else those of its spec's
        names, as the builder writes them: ``x:t`` → ``t``)."""
        with self.db.write() as c:
            c.execute("UPDATE builds SET tags = ? WHERE id = ?", (json.dumps(tags), build_id))

    def _tag_ready_build(self, c: sqlite3.Connection, build_id: str) -> None:
        """Keep the build's outcome (what the template record says, when it names this
        build) and move the build's tags to it."""
        b = c.execute("SELECT template_id, spec, tags FROM builds WHERE id = ?",
                      (build_id,)).fetchone()
        t = b and c.execute("SELECT * FROM templates WHERE id = ?", (b["template_id"],)
                            ).fetchone()
        if not t:
            return
        if t["build_id"] == build_id:
            rec = from_row(TemplateRecord, t)
            c.execute("UPDATE builds SET outcome = ? WHERE id = ?",
                      (json.dumps({f: getattr(rec, f) for f in _OUTCOME}), build_id))
        if b["tags"] is not None:
            tags = json.loads(b["tags"])
        else:
            names = (json.loads(b["spec"]) if b["spec"] else {}).get("names", [])
            tags = [n.partition(":")[2].lower() for n in names if ":" in n] or [DEFAULT_TAG]
        self._put_tags(c, b["template_id"], build_id, tags)

    @staticmethod
    def _put_tags(c: sqlite3.Connection, template_id: str, build_id: str,
                  tags: builtins.list[str]) -> None:
        now = time.time()
        c.executemany(
            "INSERT INTO template_tags (template_id, tag, build_id, created_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (template_id, tag) DO UPDATE SET "
            "build_id = excluded.build_id, created_at = excluded.created_at",
            [(template_id, tag, build_id, now) for tag in tags])

    # -- tags -----------------------------------------------------------------------------

    def tags(self, template_id: str) -> builtins.list[TemplateTag]:
        """The template's tags by name; ``default`` is listed even when implicit."""
        out = [TemplateTag(r[0], r[1], r[2]) for r in self.db.query(
            "SELECT tag, build_id, created_at FROM template_tags WHERE template_id = ? "
            "ORDER BY tag", (template_id,))]
        if all(t.tag != DEFAULT_TAG for t in out):
            rows = self.db.query(
                "SELECT t.build_id, COALESCE(b.finished_at, t.created_at) FROM templates t "
                "LEFT JOIN builds b ON b.id = t.build_id "
                "WHERE t.id = ? AND t.status = ? AND t.build_id != ''",
                (template_id, BuildStatus.READY))
            if rows:
                out.append(TemplateTag(DEFAULT_TAG, rows[0][0], rows[0][1]))
                out.sort(key=lambda t: t.tag)
        return out

    def tag_build(self, template_id: str, tag: str) -> str | None:
        """The id of the ready build ``tag`` (or a build id) names on the template, if any."""
        rows = self.db.query("SELECT * FROM templates WHERE id = ?", (template_id,))
        found = self._build_for(self._with_names(rows[0]), tag) if rows else None
        return found[0] if found else None

    def assign_tags(self, template_id: str, build_id: str, tags: builtins.list[str]) -> None:
        """Point ``tags`` at ``build_id`` (from ``tag_build``), wherever they pointed."""
        with self.db.write() as c:
            self._put_tags(c, template_id, build_id, tags)

    def remove_tags(self, template_id: str, tags: builtins.list[str]) -> None:
        with self.db.write() as c:
            c.executemany("DELETE FROM template_tags WHERE template_id = ? AND tag = ?",
                          [(template_id, t) for t in tags])

    def tagged_images(self) -> set[str]:
        """Images of older builds that a tag still names (the current ones are in the
        template records): garbage collection must keep them."""
        return {r[0] for r in self.db.query(
            "SELECT DISTINCT json_extract(b.outcome, '$.image') FROM template_tags g "
            "JOIN builds b ON b.id = g.build_id AND b.template_id = g.template_id "
            "WHERE b.outcome IS NOT NULL") if r[0]}

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
            if status in BUILD_ENDED:
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

    def logs(self, build_id: str, offset: int = 0,
             limit: int = 1000) -> builtins.list[dict[str, Any]]:
        """Shown lines from ``offset`` (their ``seq``) on; held-back lines are not shown."""
        rows = self.db.query(
            "SELECT seq, ts, level, step, message FROM build_logs WHERE build_id = ? AND seq >= ? "
            "ORDER BY seq LIMIT ?", (build_id, max(0, offset), limit))
        return [dict(r) for r in rows]

    @staticmethod
    def _insert(c: sqlite3.Connection, build_id: str, seq: int, level: str, step: str | None,
                message: str, ts: float | None = None) -> None:
        c.execute("INSERT INTO build_logs VALUES (?, ?, ?, ?, ?, ?)",
                  (build_id, seq, time.time() if ts is None else ts, level, step, message))

    @staticmethod
    def _shown(c: sqlite3.Connection, build_id: str) -> int:
        shown: int = c.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM build_logs "
                         "WHERE build_id = ? AND seq >= 0", (build_id,)).fetchone()[0]
        return shown

    def _tally(self, c: sqlite3.Connection, build_id: str, shown: int, held_next: int) -> _Tally:
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

    def _show_held(self, c: sqlite3.Connection, build_id: str) -> None:
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
