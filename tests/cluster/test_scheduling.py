"""The scheduler's ranking (``aenv.cluster.scheduling``): pure functions over node records,
no Redis. Each case fails if one budget were left out of the check or the ranking."""

from __future__ import annotations

from aenv.cluster.registry import NodeRecord, NodeStatus
from aenv.cluster.scheduling import (
    CACHE_PREFERENCE,
    Ask,
    candidates,
    fullness,
    has_free_start,
    has_room,
    wait_turns,
)


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


def test_no_ready_node_with_room_or_a_queue_place_is_no_candidate() -> None:
    full = [node("a", running=64), node("b", running=60, memory_used_mb=16384)]
    assert candidates(full) == []
    assert ids(candidates([*full, node("c")])) == ["c"]
    assert candidates([node("d", alive=False)]) == []


def test_a_node_with_its_starts_taken_still_takes_a_create_into_its_queue() -> None:
    queues = node("q", starting=8, running=8, start_queue=4)
    assert has_room(queues, {}) and not has_free_start(queues, {})
    assert ids(candidates([queues])) == ["q"]
    # its queue's bound counts the queued creates and this gateway's in flight
    assert not has_room(node("q", starting=8, queued=4, start_queue=4), {})
    assert not has_room(queues, {"q": 4})
    assert has_room(queues, {"q": 3})
    # a node that publishes no queue (from before it) refuses at max_starting, as it does
    assert not has_room(node("old", starting=8), {})
    # a queue place is no way round a lasting budget
    assert not has_room(node("m", starting=8, start_queue=4, memory_used_mb=16000), {})
    # and what a node does not queue (a resume, a build) goes only where a start is free
    assert candidates([queues], queue=False) == []


def test_nodes_with_a_start_free_go_first_then_the_shortest_queue() -> None:
    # "full" is the fullest by memory but the only one with a start free
    full = node("full", memory_used_mb=14336)
    long_q = node("long", starting=8, queued=6, start_queue=64)
    short_q = node("short", starting=8, queued=1, start_queue=64, running=40)
    assert ids(candidates([long_q, short_q, full])) == ["full", "short", "long"]
    # queues are compared per start: 9 waiting on 16 starts beat 2 on one
    wide = node("wide", max_starting=16, starting=16, queued=8, start_queue=64)
    narrow = node("narrow", max_starting=1, starting=1, queued=1, start_queue=64)
    assert wait_turns(wide, {}) < wait_turns(narrow, {})
    assert ids(candidates([narrow, wide])) == ["wide", "narrow"]
    # this gateway's creates in flight lengthen a node's queue
    assert ids(candidates([long_q, short_q], {"short": 6})) == ["long", "short"]
