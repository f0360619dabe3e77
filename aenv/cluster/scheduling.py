"""Which node a create goes to: pure functions over the registry's node statuses.

This slice's rule: only ready nodes (heartbeat within its TTL, not draining) with room
(fewer sandboxes holding a VM than their ``max_sandboxes``, counting the creates this
gateway has in flight to them), fewest such sandboxes first, ties by id; a node that holds
the create's template counts ``CACHE_PREFERENCE`` fewer. The gateway tries
them in that order and moves to the next when one refuses (429, 5xx, timeout).
A paused sandbox whose node is gone or full goes to these nodes minus those that cannot
restore its snapshot (``gateway``, ``NodeRecord.restores``).
Not yet: vCPU/memory budgets.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from .registry import NodeStatus


def load(node: NodeStatus, in_flight: Mapping[str, int]) -> int:
    return node.record.running + in_flight.get(node.record.node_id, 0)


def has_room(node: NodeStatus, in_flight: Mapping[str, int]) -> bool:
    cap = node.record.max_sandboxes
    return cap <= 0 or load(node, in_flight) < cap


# A node that holds the template (no snapshot to fetch) is preferred over one with up to
# this many fewer sandboxes.
CACHE_PREFERENCE = 2


def candidates(nodes: Iterable[NodeStatus], in_flight: Mapping[str, int] | None = None,
               holders: Collection[str] = ()) -> list[NodeStatus]:
    """The nodes a create may go to, best first; ``holders`` hold its template."""
    busy = in_flight or {}
    ready = [n for n in nodes if n.status == "ready" and has_room(n, busy)]
    return sorted(ready, key=lambda n: (
        load(n, busy) - (CACHE_PREFERENCE if n.record.node_id in holders else 0),
        n.record.node_id))
