"""Which node a create goes to: pure functions over the registry's node statuses.

A node may take a create when it is ready (heartbeat within its TTL, not draining), the
create fits every lasting budget it publishes (``NodeRecord``: sandboxes holding a VM
against ``max_sandboxes``, guest vCPUs and memory against ``vcpus``/``memory_mb``; a budget
of 0 is no limit), and it has a start for it: one of its ``max_starting`` free, or a place
in the queue behind them (``start_queue``, ``aenv.orchestrator.start_queue``: the create
waits there for its turn instead of being refused). Creates this gateway has in flight to
a node count as one more sandbox each, of the create's size, and as one more start taken
or queued (the node's figures may count some of them too: an over-estimate, which costs
at most a later place in the order).

Nodes with a free start go first, least loaded first: by the largest share of a lasting
budget (sandboxes, vCPUs, memory) the node would use with the create placed (so a node
nearly out of memory ranks low even with few sandboxes), a node that holds the create's
template counting ``CACHE_PREFERENCE`` less; then fewest starting, fewest sandboxes, id.
Nodes that can only queue it come after them, shortest wait first (starts taken or queued
per start of ``max_starting``), then in the same order. The gateway tries them in that
order and moves to the next when one refuses (429, 5xx, timeout): the published usage is
a second old at most, and the node's own admission stays the judge. When no ready node
has room or a queue place for it, every budget is exhausted: the gateway answers 429 with
``Retry-After`` (``RETRY_AFTER_S``) without asking any.

A paused sandbox whose node is gone or full goes to these nodes minus those that cannot
restore its snapshot (``gateway``, ``NodeRecord.restores``).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .registry import NodeStatus

# The size a create is assumed to have when its body does not say (``cpuCount``,
# ``memoryMB``): the built-in template's. A template's own size is known only on its node;
# a wrong guess costs a refusal and the next node, never a wrong placement.
DEFAULT_VCPUS = 1
DEFAULT_MEMORY_MB = 512

# A node that holds the template (no snapshot to fetch) is preferred over one whose
# fullest budget is up to this share emptier.
CACHE_PREFERENCE = 0.1
# Retry-After (seconds) of the gateway's own 429, when no node has room or a queue place.
# The figures it judged by are a heartbeat old at most (``registry.DEFAULT_TTL_S`` / 3), so
# a retry a little later sees fresh ones.
RETRY_AFTER_S = 2


@dataclass(frozen=True)
class Ask:
    """What one create needs."""

    vcpus: int = DEFAULT_VCPUS
    memory_mb: int = DEFAULT_MEMORY_MB

    @classmethod
    def of(cls, body: bytes) -> Ask:
        """The size a create request asks for (aenv's ``cpuCount``/``memoryMB``), else the
        defaults."""
        try:
            data = json.loads(body) if body else {}
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}
        cpus, memory = data.get("cpuCount"), data.get("memoryMB")
        return cls(cpus if isinstance(cpus, int) and cpus > 0 else DEFAULT_VCPUS,
                   memory if isinstance(memory, int) and memory > 0 else DEFAULT_MEMORY_MB)


def load(node: NodeStatus, in_flight: Mapping[str, int]) -> int:
    """Sandboxes holding a VM there, with this gateway's creates in flight."""
    return node.record.running + in_flight.get(node.record.node_id, 0)


def shares(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> list[float]:
    """Per published lasting budget (sandboxes, vCPUs, memory), the share of it used once
    the in-flight creates and this one are placed (over 1.0: does not fit)."""
    r = node.record
    extra = in_flight.get(r.node_id, 0) + 1
    used = ((r.running + extra, r.max_sandboxes),
            (r.vcpus_used + extra * ask.vcpus, r.vcpus),
            (r.memory_used_mb + extra * ask.memory_mb, r.memory_mb))
    return [u / cap for u, cap in used if cap > 0]


def starting(node: NodeStatus, in_flight: Mapping[str, int]) -> int:
    """Sandboxes starting there, with this gateway's creates in flight."""
    return node.record.starting + in_flight.get(node.record.node_id, 0)


def pending(node: NodeStatus, in_flight: Mapping[str, int]) -> int:
    """Starts taken or queued there, with this gateway's creates in flight."""
    return starting(node, in_flight) + node.record.queued


def fits(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> bool:
    """Whether the create fits every lasting budget the node publishes."""
    return all(s <= 1.0 for s in shares(node, in_flight, ask))


def has_free_start(node: NodeStatus, in_flight: Mapping[str, int]) -> bool:
    """Whether one of the node's ``max_starting`` starts is free (0: no limit)."""
    cap = node.record.max_starting
    return cap <= 0 or pending(node, in_flight) < cap


def can_queue(node: NodeStatus, in_flight: Mapping[str, int]) -> bool:
    """Whether the node has a start free or a place in its start queue."""
    cap = node.record.max_starting
    return cap <= 0 or pending(node, in_flight) < cap + max(node.record.start_queue, 0)


def has_room(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> bool:
    """Whether the node may take the create now or queue it."""
    return fits(node, in_flight, ask) and can_queue(node, in_flight)


def wait_turns(node: NodeStatus, in_flight: Mapping[str, int]) -> float:
    """How many starts' time a create placed now waits for its turn (0: a start is free)."""
    cap = node.record.max_starting
    if has_free_start(node, in_flight):
        return 0.0
    return (pending(node, in_flight) - cap + 1) / cap


def fullness(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> float:
    """The largest share of any budget the node would use with the create; 0 for a node
    that publishes no budget."""
    return max(shares(node, in_flight, ask), default=0.0)


def candidates(nodes: Iterable[NodeStatus], in_flight: Mapping[str, int] | None = None,
               holders: Collection[str] = (), ask: Ask = Ask(), *,
               queue: bool = True) -> list[NodeStatus]:
    """The nodes a create of size ``ask`` may go to, best first (the module's order);
    ``holders`` hold its template. Empty when no ready node has room or a queue place.
    ``queue`` False: only nodes with a start free, for what a node does not queue (a
    resume taken over from another node, a template build)."""
    busy = in_flight or {}
    ready = [n for n in nodes if n.status == "ready" and fits(n, busy, ask)
             and (can_queue(n, busy) if queue else has_free_start(n, busy))]
    return sorted(ready, key=lambda n: (
        wait_turns(n, busy),
        fullness(n, busy, ask) - (CACHE_PREFERENCE if n.record.node_id in holders else 0.0),
        starting(n, busy),
        load(n, busy),
        n.record.node_id))
