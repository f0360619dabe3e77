"""Filtering and pagination of ``GET /v2/sandboxes`` (and the v1 list).

The SDKs encode the metadata filter three times over (spec 2.5): decode the parameter,
unquote the whole string, then split on ``&``/``=`` and unquote each key and value. Pages
are ordered by (startedAt, sandboxID); the next-page token is an opaque cursor of that key.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from urllib.parse import unquote

from ..store import SandboxRecord, SandboxStore
from .errors import ApiError
from .views import API_STATES, internal_states

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    if not raw:
        return {}
    out = {}
    for pair in unquote(raw).split("&"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep:
            raise ApiError(400, f"invalid metadata filter '{pair}': expected key=value")
        out[unquote(key)] = unquote(value)
    return out


def parse_states(raw: str | None) -> set[str]:
    if not raw:
        return set(API_STATES)
    states = {s.strip() for s in raw.split(",") if s.strip()}
    bad = states - API_STATES
    if bad:
        raise ApiError(400, f"invalid state filter: {', '.join(sorted(bad))}")
    return states


def parse_time(raw: str | None) -> float | None:
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ApiError(400, f"invalid startedAfter '{raw}': expected RFC 3339") from None


def encode_cursor(rec: SandboxRecord) -> str:
    return base64.urlsafe_b64encode(json.dumps([rec.started_at, rec.id]).encode()).decode()


def decode_cursor(token: str) -> tuple[float, str]:
    try:
        started, sid = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(started), str(sid)
    except (ValueError, TypeError):
        raise ApiError(400, "invalid nextToken") from None


def select(
    store: SandboxStore, *, metadata: dict[str, str], states: set[str],
    started_after: float | None = None, template: str | None = None, order: str = "desc",
    limit: int | None = None, next_token: str | None = None,
) -> tuple[list[SandboxRecord], str | None]:
    """One page of matching sandboxes and the token of the next page (None at the end)."""
    if order not in ("asc", "desc"):
        raise ApiError(400, f"invalid order '{order}': expected asc or desc")
    limit = DEFAULT_LIMIT if limit is None else limit
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be between 1 and {MAX_LIMIT}")
    rows = store.page(
        states=internal_states(states), metadata=metadata, started_after=started_after,
        template=template, descending=order == "desc",
        after=decode_cursor(next_token) if next_token else None, limit=limit + 1)
    page = rows[:limit]
    return page, encode_cursor(page[-1]) if len(rows) > limit else None
