"""Which node a create goes to: pure functions over the registry's node statuses.

A node may take a create when it is ready (heartbeat within its TTL, not draining) and the
create fits every budget it publishes (``NodeRecord``: sandboxes holding a VM against
``max_sandboxes``, sandboxes starting against ``max_starting``, guest vCPUs and memory
against ``vcpus``/``memory_mb``; a budget of 0 is no limit), counting the creates this
gateway has in flight to it (each as one more sandbox, starting, of the create's size).
Those nodes go least loaded first: by the largest share of a lasting budget (sandboxes,
vCPUs, memory) the node would use with the create placed (so a node nearly out of memory
ranks low even with few sandboxes), a node that holds the create's template counting
``CACHE_PREFERENCE`` less; then fewest starting (a passing budget: a filter and a
tie-break, not a share, or every idle node would look 1/max_starting full), fewest
sandboxes, id. The gateway tries them in that order and moves
to the next when one refuses (429, 5xx, timeout): the published usage is a second old at
most, and the node's own admission stays the judge.

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


def has_room(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> bool:
    cap = node.record.max_starting
    return (cap <= 0 or starting(node, in_flight) < cap) and \
        all(s <= 1.0 for s in shares(node, in_flight, ask))


def fullness(node: NodeStatus, in_flight: Mapping[str, int], ask: Ask = Ask()) -> float:
    """The largest share of any budget the node would use with the create; 0 for a node
    that publishes no budget."""
    return max(shares(node, in_flight, ask), default=0.0)


def candidates(nodes: Iterable[NodeStatus], in_flight: Mapping[str, int] | None = None,
               holders: Collection[str] = (), ask: Ask = Ask(), *,
               overflow: bool = False) -> list[NodeStatus]:
    """The nodes a create of size ``ask`` may go to, best first; ``holders`` hold its
    template. ``overflow``: when no node has room by what they published, every ready
    node, in the same order: the usage read is up to a heartbeat old, and a node's own
    admission may queue a start rather than refuse it."""
    busy = in_flight or {}
    live = [n for n in nodes if n.status == "ready"]
    ready = [n for n in live if has_room(n, busy, ask)]
    if not ready and overflow:
        ready = live
    return sorted(ready, key=lambda n: (
        fullness(n, busy, ask) - (CACHE_PREFERENCE if n.record.node_id in holders else 0.0),
        starting(n, busy),
        load(n, busy),
        n.record.node_id))
