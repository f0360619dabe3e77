"""List filters and pagination of GET /v2/sandboxes."""

from __future__ import annotations

from urllib.parse import unquote

import pytest

from aenv.api.errors import ApiError
from aenv.api.listing import parse_metadata_filter, parse_states, select
from aenv.store import Database, SandboxRecord, SandboxStore


def _store(recs: list[SandboxRecord]) -> SandboxStore:
    store = SandboxStore(Database(":memory:"))
    for r in recs:
        store.insert(r)
    return store


def _rec(i: int, **meta: str) -> SandboxRecord:
    return SandboxRecord(id=f"s{i:02d}", template_id="base", state="running", client_id="c",
                         started_at=1000.0 + i, end_at=2000.0, cpu_count=1, memory_mb=256,
                         disk_size_mb=1024, metadata=meta)


def test_metadata_filter_is_decoded_in_three_steps() -> None:
    # Captured from SDK 2.63.0 for {"k": "v w", "a&b": "c=d"} (spec 2.5); the HTTP layer
    # decodes the query parameter once before the route sees it.
    wire = "k%3Dv%252520w%26a%252526b%3Dc%25253Dd"
    assert parse_metadata_filter(unquote(wire)) == {"k": "v w", "a&b": "c=d"}


def test_a_filter_pair_without_equals_is_400() -> None:
    with pytest.raises(ApiError):
        parse_metadata_filter("justakey")


def test_states_default_to_both_and_reject_unknown() -> None:
    assert parse_states(None) == {"running", "paused"}
    with pytest.raises(ApiError):
        parse_states("running,dead")


def test_pages_are_newest_first_and_resume_after_the_cursor() -> None:
    recs = _store([_rec(i, g="x") for i in range(5)] + [_rec(9, g="y")])
    page, token = select(recs, metadata={"g": "x"}, states={"running"}, limit=2)
    assert [r.id for r in page] == ["s04", "s03"] and token
    page2, token2 = select(recs, metadata={"g": "x"}, states={"running"}, limit=2,
                           next_token=token)
    assert [r.id for r in page2] == ["s02", "s01"]
    page3, token3 = select(recs, metadata={"g": "x"}, states={"running"}, limit=2,
                           next_token=token2)
    assert [r.id for r in page3] == ["s00"] and token3 is None


def test_all_metadata_pairs_must_match() -> None:
    recs = _store([_rec(1, a="1", b="2"), _rec(2, a="1")])
    page, _ = select(recs, metadata={"a": "1", "b": "2"}, states={"running"})
    assert [r.id for r in page] == ["s01"]


def test_paused_and_internal_states_fold_into_the_api_states() -> None:
    recs = [_rec(1), _rec(2), _rec(3), _rec(4)]
    recs[1].state, recs[2].state, recs[3].state = "paused", "pausing", "killed"
    page, _ = select(_store(recs), metadata={}, states={"paused"})
    assert [r.id for r in page] == ["s03", "s02"]
    page, _ = select(_store(recs), metadata={}, states={"running", "paused"})
    assert "s04" not in [r.id for r in page]


def test_every_live_state_has_an_api_view_and_no_other_state_does() -> None:
    from aenv.api.views import API_STATES, internal_states
    from aenv.store import LIVE_STATES

    assert set(API_STATES) == {"running", "paused"}
    assert set(internal_states(API_STATES)) == set(LIVE_STATES)


def test_metadata_keys_with_quotes_and_dots_match_exactly() -> None:
    recs = _store([_rec(1, **{'a.b"c': "v"}), _rec(2, a="v")])
    page, _ = select(recs, metadata={'a.b"c': "v"}, states={"running"})
    assert [r.id for r in page] == ["s01"]


async def test_started_after_its_own_start_time_includes_the_sandbox() -> None:
    """The SDK reads startedAt (microseconds) and sends it back as startedAfter."""
    from aenv.api.listing import parse_time
    from aenv.api.views import rfc3339
    from aenv.orchestrator.service import CreateOptions, Orchestrator
    from aenv.store import TemplateRecord, TemplateStore
    from tests.orchestrator.test_orchestrator import FakeMachines

    db = Database(":memory:")
    sandboxes, templates = SandboxStore(db), TemplateStore(db)
    templates.insert(TemplateRecord(id="base", kind="template", build_id="b", status="ready",
                                    cpu_count=1, memory_mb=256, disk_size_mb=1024,
                                    created_at=1.0, updated_at=1.0, names=["base"]))
    # Sub-microsecond parts that the API rounds up (.1234567 is shown as .123457).
    for t in (1764876739.1234567, 1764876739.9999996, 1764876740.0000004):
        orch = Orchestrator(sandboxes, templates, FakeMachines(), clock=lambda t=t: t)
        rec = await orch.create(CreateOptions(template="base"))
        after = parse_time(rfc3339(rec.started_at))
        page, _ = select(sandboxes, metadata={}, states={"running"}, started_after=after)
        assert rec.id in [r.id for r in page], (t, rfc3339(rec.started_at))
