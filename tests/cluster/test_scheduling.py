"""The scheduler's ranking (``aenv.cluster.scheduling``): pure functions over node records,
no Redis. Each case fails if one budget were left out of the check or the ranking."""

from __future__ import annotations

from aenv.cluster.registry import NodeRecord, NodeStatus
from aenv.cluster.scheduling import CACHE_PREFERENCE, Ask, candidates, fullness, has_room


def node(node_id: str, *, alive: bool = True, **kw: object) -> NodeStatus:
    budgets: dict[str, object] = {"max_sandboxes": 64, "max_starting": 8, "vcpus": 32,
                                  "memory_mb": 16384}
    budgets.update(kw)
    return NodeStatus(NodeRecord(node_id, f"http://127.0.0.1:1/{node_id}", "t",
                                 **budgets), alive)  # type: ignore[arg-type]


def ids(nodes: list[NodeStatus]) -> list[str]:
    return [n.record.node_id for n in nodes]


def test_each_budget_keeps_a_create_off_a_node_it_does_not_fit() -> None:
    fits = node("ok")
    cases = {
        "sandboxes": node("s", running=64),
        "starting": node("st", starting=8, running=8),
        "vcpus": node("c", vcpus_used=32),
        "memory": node("m", memory_used_mb=16000),   # 384 MiB free, 512 asked
    }
    for why, full in cases.items():
        assert ids(candidates([full, fits])) == ["ok"], why
        assert not has_room(full, {})
    # a smaller create still fits where memory is short
    assert has_room(cases["memory"], {}, Ask(1, 256))
    # 0: a budget the node does not publish is no limit
    assert has_room(node("free", max_sandboxes=0, vcpus=0, memory_mb=0, max_starting=0,
                         running=10_000), {})


def test_the_least_full_budget_wins_not_the_fewest_sandboxes() -> None:
    # "few" has fewer sandboxes, but they use most of its memory
    few = node("few", running=2, vcpus_used=8, memory_used_mb=12288)
    many = node("many", running=10, vcpus_used=10, memory_used_mb=5120)
    assert ids(candidates([few, many])) == ["many", "few"]
    assert fullness(few, {}) > fullness(many, {})
    # a bigger create weighs memory more: 4 GiB more fills "few" (16384/16384)
    assert ids(candidates([few, many], ask=Ask(1, 4096))) == ["many", "few"]
    assert not has_room(few, {}, Ask(1, 4097))


def test_creates_in_flight_count_against_every_budget() -> None:
    a = node("a", starting=5, running=5)
    b = node("b", running=20)
    # a is emptier until this gateway's creates to it fill its starting budget (8)
    assert ids(candidates([a, b])) == ["a", "b"]
    assert ids(candidates([a, b], {"a": 2})) == ["a", "b"]
    assert ids(candidates([a, b], {"a": 3})) == ["b"]
    mem = node("mem", memory_used_mb=15360)      # 1 GiB left: two creates of 512
    assert has_room(mem, {"mem": 1})
    assert not has_room(mem, {"mem": 2})


def test_only_ready_nodes_and_the_template_holder_is_preferred_within_its_margin() -> None:
    draining = NodeStatus(NodeRecord("d", "http://x", "t", draining=True), True)
    dead = node("x", alive=False)
    a = node("a", running=4)                     # 5/64 with the create
    b = node("b", running=7)                     # 8/64: holds the template
    assert ids(candidates([draining, dead, a, b])) == ["a", "b"]
    assert ids(candidates([a, b], holders={"b"})) == ["b", "a"]
    # beyond the preference's margin the emptier node wins anyway
    far = node("b", running=4 + int(64 * CACHE_PREFERENCE) + 2)
    assert ids(candidates([a, far], holders={"b"})) == ["a", "b"]


def test_ties_go_to_fewer_starting_then_fewer_sandboxes_then_id() -> None:
    nodes = [node("c", running=3), node("b", running=3), node("a", running=3, starting=1,
                                                                  max_starting=64)]
    # same fullness (4/64): a starts one already
    assert ids(candidates(nodes)) == ["b", "c", "a"]


def test_the_asked_size_comes_from_the_create_body() -> None:
    assert Ask.of(b'{"templateID": "base", "cpuCount": 4, "memoryMB": 2048}') == Ask(4, 2048)
    assert Ask.of(b'{"templateID": "base"}') == Ask()
    assert Ask.of(b"not json") == Ask()
    assert Ask.of(b'{"cpuCount": "4", "memoryMB": -1}') == Ask()
    assert Ask.of(b"[1]") == Ask()


def test_overflow_offers_every_ready_node_when_none_has_room_by_its_figures() -> None:
    full = [node("a", running=64), node("b", running=60, memory_used_mb=16384)]
    assert candidates(full) == []
    assert ids(candidates(full, overflow=True)) == ["a", "b"]  # a: 65/64, b: memory 1.03
    assert ids(candidates([*full, node("c")], overflow=True)) == ["c"]
    assert candidates([node("d", alive=False)], overflow=True) == []
