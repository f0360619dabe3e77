"""The sandbox lifecycle as one table: the store makes every change it lists and refuses
every other, and the enums keep the stored values as they were."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from aenv.store import (
    LIVE_STATES,
    TRANSITIONS,
    VM_STATES,
    BuildRecord,
    BuildStatus,
    Database,
    IllegalTransition,
    SandboxRecord,
    SandboxState,
    SandboxStore,
    TemplateKind,
    TemplateRecord,
    TemplateStore,
)

S = SandboxState


def _store() -> SandboxStore:
    return SandboxStore(Database(":memory:"))


def _insert(store: SandboxStore, state: SandboxState, sandbox_id: str = "sbx") -> str:
    # ``insert`` takes any state: the table governs changes, not where a row starts.
    store.insert(SandboxRecord(id=sandbox_id, template_id="base", state=state, client_id="c",
                               started_at=1.0, end_at=2.0, cpu_count=1, memory_mb=256,
                               disk_size_mb=1024))
    return sandbox_id


def _state(store: SandboxStore, sandbox_id: str) -> SandboxState:
    rec = store.get(sandbox_id, live_only=False)
    assert rec is not None
    return rec.state


def test_the_table_has_a_row_for_every_state() -> None:
    assert set(TRANSITIONS) == set(SandboxState)
    assert all(to in SandboxState for tos in TRANSITIONS.values() for to in tos)


def test_every_arrow_of_the_table_is_a_change_the_store_makes() -> None:
    for i, (frm, to) in enumerate((f, t) for f in SandboxState for t in TRANSITIONS[f]):
        store = _store()
        sid = _insert(store, frm, f"s{i}")
        assert store.transition(sid, [frm], to), f"{frm} -> {to}"
        assert _state(store, sid) is to


def test_every_change_the_table_leaves_out_raises_and_writes_nothing() -> None:
    store = _store()
    for i, (frm, to) in enumerate(itertools.product(SandboxState, SandboxState)):
        if to in TRANSITIONS[frm]:
            continue
        sid = _insert(store, frm, f"s{i}")
        with pytest.raises(IllegalTransition) as e:
            store.transition(sid, [frm], to, reason="should not be written")
        assert (e.value.sandbox_id, e.value.from_state, e.value.to_state) == (sid, frm, to)
        rec = store.get(sid, live_only=False)
        assert rec.state is frm and rec.reason is None


def test_one_illegal_source_refuses_the_whole_compare_and_set() -> None:
    store = _store()
    sid = _insert(store, S.PAUSED)
    with pytest.raises(IllegalTransition):
        store.transition(sid, [S.PAUSED, S.KILLED], S.RESUMING)
    assert _state(store, sid) is S.PAUSED


def test_a_name_that_is_no_state_is_an_illegal_transition() -> None:
    store = _store()
    sid = _insert(store, S.RUNNING)
    with pytest.raises(IllegalTransition):
        store.transition(sid, ["running"], "sleeping")
    with pytest.raises(IllegalTransition):
        store.transition(sid, ["asleep"], "running")
    assert _state(store, sid) is S.RUNNING


def test_a_legal_change_from_a_state_the_row_is_not_in_is_a_lost_race_not_an_error() -> None:
    store = _store()
    sid = _insert(store, S.KILLING)
    assert store.transition(sid, ["running"], "pausing") is False
    assert _state(store, sid) is S.KILLING


def test_an_illegal_transition_is_a_server_fault_not_a_client_error() -> None:
    from aenv.api.errors import failure_response
    from aenv.orchestrator.errors import OrchestratorError

    err = IllegalTransition("sbx", S.KILLED, S.RUNNING)
    assert not isinstance(err, OrchestratorError)
    answer = failure_response(err)
    assert answer.status_code == 500
    assert json.loads(answer.body)["message"] == "internal error: IllegalTransition"


def test_every_state_but_building_is_reachable_from_creating() -> None:
    seen, todo = {S.CREATING}, [S.CREATING]
    while todo:
        for to in TRANSITIONS[todo.pop()] - seen:
            seen.add(to)
            todo.append(to)
    assert seen == set(SandboxState) - {S.BUILDING}


def test_every_live_state_can_be_killed_and_an_ended_one_never_lives_again() -> None:
    for s in LIVE_STATES:
        assert S.KILLING in TRANSITIONS[s], s
    for s in set(SandboxState) - set(LIVE_STATES):
        assert not TRANSITIONS[s] & set(LIVE_STATES), s


def test_the_state_sets_are_the_ones_the_literals_were() -> None:
    assert set(LIVE_STATES) == {"creating", "running", "pausing", "paused", "resuming",
                                "snapshotting", "forking", "killing"}
    assert set(VM_STATES) == {"creating", "running", "resuming", "forking", "snapshotting",
                              "pausing"}


def test_members_are_stored_and_shown_as_their_plain_values() -> None:
    assert S.RUNNING == "running" and f"{S.PAUSED}" == "paused" and str(S.LOST) == "lost"
    assert json.dumps({"state": S.KILLING}) == '{"state": "killing"}'
    db = Database(":memory:")
    store = SandboxStore(db)
    _insert(store, S.PAUSED)
    assert db.query("SELECT state, typeof(state) FROM sandboxes")[0][:] == ("paused", "text")


def test_records_read_their_lifecycle_columns_back_as_enums() -> None:
    db = Database(":memory:")
    store = SandboxStore(db)
    sid = _insert(store, "running")  # a plain string, as older code wrote
    assert store.get(sid).state is S.RUNNING
    templates = TemplateStore(db)
    templates.insert(TemplateRecord(id="t", kind="snapshot", build_id="b", status="ready",
                                    cpu_count=1, memory_mb=256, disk_size_mb=1024,
                                    created_at=1.0, updated_at=1.0))
    tpl = templates.get("t")
    assert tpl.kind is TemplateKind.SNAPSHOT and tpl.status is BuildStatus.READY
    templates.insert_build(BuildRecord(id="b", template_id="t", status="waiting",
                                       created_at=1.0))
    assert templates.get_build("b").status is BuildStatus.WAITING


def _doc_table() -> dict[str, set[str]]:
    """docs/architecture.md's lifecycle table: backticked state of each row's first column
    → the backticked states of its second."""
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Lifecycle\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert [c.strip() for c in rows[0].strip("|").split("|")] == ["from", "to"]
    table: dict[str, set[str]] = {}
    for line in rows[2:]:  # past the header and its |---| line
        frm, to = (c.strip() for c in line.strip("|").split("|"))
        (name,) = re.fullmatch(r"`(\w+)`", frm).groups()
        assert name not in table, f"{name} has two rows"
        table[name] = set(re.findall(r"`(\w+)`", to))
    return table


def test_the_docs_draw_the_same_table_as_the_code() -> None:
    assert _doc_table() == {str(s): {str(t) for t in tos} for s, tos in TRANSITIONS.items()}
