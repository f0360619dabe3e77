"""Sandbox rows: insert, compare-and-set state transitions, queries for the API.

``transition`` is the only way the state column changes: it names the states a sandbox may
be in for the change to apply, so concurrent requests race in SQLite, not in our code. It
refuses a change that ``states.TRANSITIONS`` does not list (``IllegalTransition``) before
it writes anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .db import Database
from .records import SandboxRecord, encode_changes, from_row, to_columns
from .states import LIVE_STATES, SandboxState, check_transition

__all__ = ["LIVE_STATES", "SandboxStore"]


class SandboxStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def insert(self, rec: SandboxRecord) -> SandboxRecord:
        with self.db.write() as c:
            rec.seq = c.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM sandboxes").fetchone()[0]
            cols = to_columns(rec)
            c.execute(
                f"INSERT INTO sandboxes ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                tuple(cols.values()),
            )
        return rec

    def get(self, sandbox_id: str, *, live_only: bool = True) -> SandboxRecord | None:
        sql = "SELECT * FROM sandboxes WHERE id = ?"
        if live_only:
            sql += f" AND state IN ({','.join('?' * len(LIVE_STATES))})"
            rows = self.db.query(sql, (sandbox_id, *LIVE_STATES))
        else:
            rows = self.db.query(sql, (sandbox_id,))
        return from_row(SandboxRecord, rows[0]) if rows else None

    def by_idempotency_key(self, key: str) -> SandboxRecord | None:
        rows = self.db.query("SELECT * FROM sandboxes WHERE idempotency_key = ?", (key,))
        return from_row(SandboxRecord, rows[0]) if rows else None

    def transition(
        self, sandbox_id: str, from_states: Iterable[SandboxState], to_state: SandboxState,
        **changes: Any
    ) -> bool:
        """Set ``state=to_state`` (and ``changes``) only if the current state is one of
        ``from_states``. True when this call made the change. Raises
        ``IllegalTransition`` when a ``from_states → to_state`` is not in the table."""
        src, changes["state"] = check_transition(sandbox_id, from_states, to_state)
        cols = encode_changes(changes)
        sets = ",".join(f"{k} = ?" for k in cols)
        with self.db.transaction() as c:
            cur = c.execute(
                f"UPDATE sandboxes SET {sets} WHERE id = ? AND state IN "
                f"({','.join('?' * len(src))})",
                (*cols.values(), sandbox_id, *src),
            )
            return cur.rowcount == 1

    def update(self, sandbox_id: str, **changes: Any) -> None:
        """Change fields other than the state (TTL, pid, ...)."""
        assert "state" not in changes, "use transition() to change the state"
        cols = encode_changes(changes)
        with self.db.transaction() as c:
            c.execute(
                f"UPDATE sandboxes SET {','.join(f'{k} = ?' for k in cols)} WHERE id = ?",
                (*cols.values(), sandbox_id),
            )

    def in_states(self, states: Iterable[SandboxState]) -> list[SandboxRecord]:
        st = tuple(states)
        rows = self.db.query(
            f"SELECT * FROM sandboxes WHERE state IN ({','.join('?' * len(st))}) ORDER BY seq",
            st,
        )
        return [from_row(SandboxRecord, r) for r in rows]

    def page(self, *, states: Iterable[SandboxState], metadata: dict[str, str] | None = None,
             started_after: float | None = None, template: str | None = None,
             descending: bool = True, after: tuple[float, str] | None = None,
             limit: int = 100) -> list[SandboxRecord]:
        """Up to ``limit`` sandboxes in ``states`` matching every filter, ordered by
        (started_at, id), strictly past the cursor ``after``. Filtering, ordering and the
        limit run in SQLite so a page costs what it returns, not what the table holds."""
        st = tuple(states)
        where = [f"state IN ({','.join('?' * len(st))})"]
        params: list[Any] = [*st]
        for key, value in (metadata or {}).items():
            # json_each matches any key exactly (a JSON path would need quoting rules).
            where.append("EXISTS (SELECT 1 FROM json_each(metadata) WHERE key = ? AND value = ?)")
            params += [key, value]
        if started_after is not None:
            where.append("started_at >= ?")
            params.append(started_after)
        if template is not None:
            where.append("(template_id = ? OR alias = ?)")
            params += [template, template]
        if after is not None:
            where.append(f"(started_at, id) {'<' if descending else '>'} (?, ?)")
            params += [after[0], after[1]]
        direction = "DESC" if descending else "ASC"
        rows = self.db.query(
            f"SELECT * FROM sandboxes WHERE {' AND '.join(where)} "
            f"ORDER BY started_at {direction}, id {direction} LIMIT ?", (*params, limit))
        return [from_row(SandboxRecord, r) for r in rows]

    def live(self) -> list[SandboxRecord]:
        return self.in_states(LIVE_STATES)

    def count(self, states: Iterable[SandboxState]) -> int:
        st = tuple(states)
        n: int = self.db.query(
            f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({','.join('?' * len(st))})", st
        )[0][0]
        return n

    def expired(self, now: float) -> list[SandboxRecord]:
        rows = self.db.query(
            "SELECT * FROM sandboxes WHERE state = ? AND end_at <= ? ORDER BY end_at",
            (SandboxState.RUNNING, now),
        )
        return [from_row(SandboxRecord, r) for r in rows]

    def purge_ended(self, before: float) -> int:
        """Forget killed/lost sandboxes that ended before ``before``."""
        with self.db.transaction() as c:
            placeholders = ",".join("?" * len(LIVE_STATES))
            cur = c.execute(
                f"DELETE FROM sandboxes WHERE state NOT IN ({placeholders}) AND ended_at < ?",
                (*LIVE_STATES, before),
            )
            return cur.rowcount


    def forget_ended(self, sandbox_id: str) -> None:
        """Remove the row of ended (killed/lost) sandbox ``sandbox_id``, if any: it comes
        back under the same id (a paused sandbox handed back from another node)."""
        with self.db.transaction() as c:
            placeholders = ",".join("?" * len(LIVE_STATES))
            c.execute(f"DELETE FROM sandboxes WHERE id = ? AND state NOT IN ({placeholders})",
                      (sandbox_id, *LIVE_STATES))
