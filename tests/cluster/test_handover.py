"""Handover offers in a shared store directory (real files): one claim wins, a failed resume
puts the offer back, and the pausing node can tell its paused sandbox moved."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aenv.cluster.handover import Handover
from aenv.storage.shared_store import SharedStore
from aenv.store import SandboxRecord, SandboxState


def _paused(snapshot: str) -> SandboxRecord:
    return SandboxRecord(id="sbx1", template_id="base", state=SandboxState.RUNNING,
                         client_id="c", started_at=1.0, end_at=2.0, cpu_count=1,
                         memory_mb=512, disk_size_mb=2048, metadata={"k": "v"},
                         envd_token="tok", snapshot_id=f"snapshot:{snapshot}", vm_pid=42,
                         slot=3, host_ip="10.0.0.1", pause_mode="full")


def _published(store: SharedStore, snapshot: str) -> None:
    ref = store.root / "refs" / snapshot
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text("0" * 64)


def test_one_claim_wins_and_the_pausing_node_sees_the_sandbox_moved(tmp_path: Path) -> None:
    store = SharedStore(tmp_path)
    a, b, c = (Handover(store, n) for n in ("a", "b", "c"))
    rec = _paused("s1")
    assert not a.moved(dataclasses.replace(rec, state=SandboxState.PAUSED))  # unpublished
    _published(store, "s1")
    a.offer(rec, {"driver": "qemu"})
    paused = dataclasses.replace(rec, state=SandboxState.PAUSED)
    assert a.published(paused) and not a.moved(paused)
    offer = b.peek("sbx1")
    assert offer is not None and offer.node_id == "a" and offer.requires == {"driver": "qemu"}
    assert offer.record.state == SandboxState.PAUSED and offer.record.vm_pid is None
    assert offer.record.metadata == {"k": "v"} and offer.record.envd_token == "tok"

    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(lambda h: h.claim("sbx1"), [b, c] * 4))
    assert sum(x is not None for x in claims) == 1
    assert a.moved(paused)
    assert not list((tmp_path / "handover").iterdir())  # nothing left behind

    won = next(x for x in claims if x is not None)
    b.put_back(won)                                       # its resume failed
    assert not a.moved(paused) and c.claim("sbx1") is not None


def test_a_new_pause_elsewhere_is_a_move_too(tmp_path: Path) -> None:
    store = SharedStore(tmp_path)
    a, b = Handover(store, "a"), Handover(store, "b")
    _published(store, "s1")
    _published(store, "s2")
    a.offer(_paused("s1"), {})
    assert b.claim("sbx1") is not None
    b.offer(_paused("s2"), {})                             # b resumed, then paused it again
    assert a.moved(dataclasses.replace(_paused("s1"), state=SandboxState.PAUSED))
    assert not b.moved(dataclasses.replace(_paused("s2"), state=SandboxState.PAUSED))


def test_a_shared_template_resolves_by_id_and_by_name(tmp_path: Path) -> None:
    from aenv.cluster.handover import SharedTemplates
    from aenv.store import BuildStatus, TemplateKind, TemplateRecord

    shelf = SharedTemplates(SharedStore(tmp_path))
    rec = TemplateRecord(id="t1", kind=TemplateKind.SNAPSHOT, build_id="b",
                         status=BuildStatus.READY, cpu_count=1, memory_mb=512,
                         disk_size_mb=2048, created_at=1.0, updated_at=2.0,
                         image="snapshot:s1", envd_token="tok", spawn_count=7,
                         names=["team/snap:default"], env_vars={"A": "1"})
    shelf.put(rec)
    for ref in ("t1", "team/snap:default"):
        got = shelf.get(ref)
        assert got == dataclasses.replace(rec, spawn_count=0), ref
        assert got is not None and got.kind is TemplateKind.SNAPSHOT
    assert shelf.get("nope") is None and shelf.get("team") is None
    shelf.remove(rec)
    assert shelf.get("t1") is None and shelf.get("team/snap:default") is None
