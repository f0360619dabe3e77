"""The cluster's shared state in Redis: node records, liveness, the sandbox -> node index.

Key layout (all under ``prefix``, ``aenv:`` by default; the URL's DB number separates
clusters sharing one Redis):

- ``nodes`` (hash): node id -> ``NodeRecord`` as JSON: URL, version, counts, capacity,
  the time of its last publish. Kept when the node dies, so ``GET /nodes`` can show it as
  unhealthy.
- ``alive:<id>`` (string with a TTL of a few seconds): present while the node heartbeats.
  Only nodes with it are scheduled or routed to.
- ``sandboxes`` (hash): sandbox id -> node id, for every live sandbox (running, paused,
  fork children) of every node.
- ``node:<id>:sandboxes`` (set): the ids that node last published, so a republish can
  remove the ones it no longer has.
- ``templates`` (hash): template id or alias -> the node that built it (gateways write
  it when a build request succeeds); ``template:<ref>:nodes`` (set): nodes that hold the
  template (built it, or started a sandbox from it), which creates from it prefer.
- ``requires`` (hash): sandbox id -> JSON portability requirements of a paused sandbox
  whose node offered it to the cluster (``handover``): another node may resume it.
- ``autoresume`` (set): those of them created with ``autoResume``: traffic to one whose
  node is gone makes a gateway resume it elsewhere.
- ``volumes`` (hash): volume id -> the node that holds it (volumes are node-local: their
  REST and content calls go there, and sandboxes that mount them are placed there);
  ``volume-names`` (hash): volume name -> that node; ``node:<id>:volumes`` (hash): the
  node's last published volumes, id -> name. ``volume-name:<name>`` (string with a TTL):
  a gateway's claim on a name while it creates the volume, so that two gateways cannot
  make the same name on two nodes. ``volume-templates`` (hash): persistent snapshot id or
  name -> the node whose volumes its sandboxes mount (gateways write it when a sandbox
  with volumes is snapshotted through them): creates from it go there.

Redis holds nothing a node cannot say again: ``publish`` replaces a node's whole share of
the index in one transaction (MULTI/EXEC) from what the node's store holds, and
``heartbeat`` tells the node when its liveness key had vanished (Redis restarted empty, or
the node was silent past its TTL) so it publishes again. A sandbox id belongs to one node
at a time; a paused one may move to another (``handover``), so a publish removes only the
old ids that still name the publishing node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis

DEFAULT_PREFIX = "aenv:"
# A node heartbeats every TTL/3; a node silent for TTL is out of scheduling and routing.
DEFAULT_TTL_S = 3.0


@dataclass(frozen=True)
class NodeRecord:
    """What a node says about itself (``GET /nodes`` shows it)."""

    node_id: str
    url: str
    version: str
    running: int = 0          # sandboxes holding a VM (running, creating, resuming, ...)
    paused: int = 0
    max_sandboxes: int = 0    # 0: no limit
    # Budgets (the node's own admission limits; 0: not published, no limit) and what is
    # used of them, so the gateway sends a create only where it fits (``scheduling``).
    max_starting: int = 0
    # Creates the node queues behind max_starting (``aenv.orchestrator.start_queue``; 0:
    # none, a node at max_starting refuses: what a node from before the queue published).
    start_queue: int = 0
    vcpus: int = 0            # guest vCPUs admitted: host cores x overcommit
    memory_mb: int = 0        # guest memory admitted: host RAM x overcommit
    starting: int = 0         # creating or resuming now
    queued: int = 0           # creates waiting in the start queue now
    # By the sandboxes holding a VM and the queued creates (which the node's admission
    # counts as if they ran).
    vcpus_used: int = 0
    memory_used_mb: int = 0
    draining: bool = False
    published_at: float = 0.0
    # What snapshots it restores (``shared_store.node_capabilities`` without the kernels,
    # which the node itself checks): the gateway sends a paused sandbox only to nodes that
    # can restore it.
    restores: dict[str, Any] = field(default_factory=dict)
    # Its volumes live in the shared store (``aenv.storage.shared_volumes``): it serves
    # any shared volume, and publishes none of its own.
    shared_volumes: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeRecord:
        data: dict[str, Any] = json.loads(raw)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class NodeStatus:
    """A node record as the gateway sees it: alive (heartbeat within its TTL) or not."""

    record: NodeRecord
    alive: bool

    @property
    def status(self) -> str:
        if not self.alive:
            return "unhealthy"
        return "draining" if self.record.draining else "ready"


@dataclass(frozen=True)
class Usage:
    """What a node uses of its budgets now (``NodeRecord``'s fields of the same names)."""

    starting: int = 0
    queued: int = 0
    vcpus_used: int = 0
    memory_used_mb: int = 0


@dataclass(frozen=True)
class IndexEntry:
    """One sandbox a node publishes, with whether it holds a VM."""

    sandbox_id: str
    running: bool = True
    # A paused sandbox offered to other nodes (shared store): its snapshot's portability
    # requirements, as JSON.
    requires: str = ""
    # Offered, and traffic resumes it (``autoResume``): a gateway does so on another node
    # when this one is gone.
    auto_resume: bool = False


@dataclass
class Registry:
    """Operations on the cluster's keys over one redis-py asyncio client."""

    client: aioredis.Redis
    prefix: str = DEFAULT_PREFIX
    ttl_s: float = DEFAULT_TTL_S
    _closed: bool = field(default=False, init=False)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = DEFAULT_TTL_S,
                 timeout_s: float = 2.0) -> Registry:
        """A registry on ``url`` (``redis://HOST:PORT/DB``); connects on first use, and
        again after Redis comes back."""
        client = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, health_check_interval=10)
        return cls(client, prefix=prefix, ttl_s=ttl_s)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.client.aclose()

    # -- keys
    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- the node's side

    async def heartbeat(self, node_id: str) -> bool:
        """Refresh the node's liveness; False when the key had vanished (first beat, Redis
        restarted empty, or the node was silent past its TTL): publish again."""
        old = await self.client.set(self._k("alive", node_id), str(time.time()),
                                    px=int(self.ttl_s * 1000), get=True)
        return old is not None

    async def publish(self, record: NodeRecord, entries: Iterable[IndexEntry],
                      volumes: Mapping[str, str] | None = None) -> None:
        """Replace the node's record and its share of the index with ``entries`` (and,
        when given, its volumes, id -> name), and mark it alive, in one transaction."""
        ids = {e.sandbox_id for e in entries}
        own = self._k("node", record.node_id, "sandboxes")
        old = _strs(await self.client.smembers(own))
        own_volumes = self._k("node", record.node_id, "volumes")
        old_volumes: dict[str, str] = {}
        if volumes is not None:
            old_volumes = {_str(k): _str(v) for k, v in
                           (await self.client.hgetall(own_volumes)).items()}
        gone = old - ids
        if gone:  # only those still ours: another node may have resumed one of them
            owners = await self.client.hmget(self._k("sandboxes"), sorted(gone))
            gone = {i for i, o in zip(sorted(gone), owners, strict=True)
                    if o is not None and _str(o) == record.node_id}
        async with self.client.pipeline(transaction=True) as p:
            if gone:
                p.hdel(self._k("sandboxes"), *gone)
            if ids:
                p.hset(self._k("sandboxes"), mapping={i: record.node_id for i in ids})
            p.delete(own)
            if ids:
                p.sadd(own, *ids)
            offered = {e.sandbox_id: e.requires for e in entries if e.requires}
            if offered:
                p.hset(self._k("requires"), mapping={k: v for k, v in offered.items()})
            unoffered = (ids - set(offered)) | gone
            if unoffered:
                p.hdel(self._k("requires"), *unoffered)
            resumable = {e.sandbox_id for e in entries if e.requires and e.auto_resume}
            if resumable:
                p.sadd(self._k("autoresume"), *resumable)
            if (ids | gone) - resumable:
                p.srem(self._k("autoresume"), *((ids | gone) - resumable))
            if volumes is not None:
                self._volumes(p, record.node_id, old_volumes, volumes)
            p.hset(self._k("nodes"), record.node_id, record.to_json())
            p.set(self._k("alive", record.node_id), str(time.time()), px=int(self.ttl_s * 1000))
            await p.execute()

    def _volumes(self, p: Any, node_id: str, old: Mapping[str, str],
                 new: Mapping[str, str]) -> None:
        """Queue on pipeline ``p`` the replacement of ``node_id``'s volumes ``old`` (id ->
        name) by ``new``. Volumes never move between nodes, so a name or id another node
        published since is that node's: only this node's entries are removed."""
        gone_ids = set(old) - set(new)
        gone_names = set(old.values()) - set(new.values())
        if gone_ids:
            p.hdel(self._k("volumes"), *gone_ids)
        if gone_names:
            p.hdel(self._k("volume-names"), *gone_names)
        own = self._k("node", node_id, "volumes")
        p.delete(own)
        if new:
            p.hset(own, mapping=dict(new))
            p.hset(self._k("volumes"), mapping={i: node_id for i in new})
            p.hset(self._k("volume-names"), mapping={n: node_id for n in new.values()})

    async def leave(self, node_id: str) -> None:
        """The node stops: out of scheduling at once (its record and index stay: its paused
        sandboxes are still its own)."""
        await self.client.delete(self._k("alive", node_id))

    # -- the gateway's side

    async def nodes(self) -> list[NodeStatus]:
        """Every node ever registered (until ``forget``), alive or not, by id."""
        raw = {_str(k): _str(v) for k, v in
               (await self.client.hgetall(self._k("nodes"))).items()}
        if not raw:
            return []
        ids = sorted(raw)
        alive = await self.client.mget([self._k("alive", i) for i in ids])
        return [NodeStatus(NodeRecord.from_json(raw[i]), a is not None)
                for i, a in zip(ids, alive, strict=True)]

    async def node(self, node_id: str) -> NodeStatus | None:
        async with self.client.pipeline(transaction=False) as p:
            p.hget(self._k("nodes"), node_id)
            p.exists(self._k("alive", node_id))
            raw, alive = await p.execute()
        if raw is None:
            return None
        return NodeStatus(NodeRecord.from_json(raw), bool(alive))

    async def locate(self, sandbox_id: str) -> str | None:
        """The id of the node holding ``sandbox_id``, if any node published it."""
        node = await self.client.hget(self._k("sandboxes"), sandbox_id)
        return None if node is None else _str(node)

    async def requires(self, sandbox_id: str) -> dict[str, Any] | None:
        """What restoring the paused ``sandbox_id`` needs, when its node offered it to the
        cluster (``handover``); None otherwise."""
        raw = await self.client.hget(self._k("requires"), sandbox_id)
        if raw is None:
            return None
        value: dict[str, Any] = json.loads(_str(raw))
        return value

    async def auto_resumes(self, sandbox_id: str) -> bool:
        """Whether traffic resumes the offered, paused ``sandbox_id`` (``autoResume``)."""
        return bool(await self.client.sismember(self._k("autoresume"), sandbox_id))

    # -- volumes (published by their nodes; names claimed by gateways)

    async def volume_node(self, volume_id: str) -> str | None:
        """The node that holds volume ``volume_id``, if any node published it."""
        node = await self.client.hget(self._k("volumes"), volume_id)
        return None if node is None else _str(node)

    async def volume_name_node(self, name: str) -> str | None:
        """The node that holds the volume named ``name``, if any node published it."""
        node = await self.client.hget(self._k("volume-names"), name)
        return None if node is None else _str(node)

    async def claim_volume_name(self, name: str, token: str, ttl_s: float) -> bool:
        """Hold ``name`` for a volume create for at most ``ttl_s``; False when another
        create holds it."""
        return bool(await self.client.set(self._k("volume-name", name), token,
                                          nx=True, px=int(ttl_s * 1000)))

    async def release_volume_name(self, name: str, token: str) -> None:
        """Give up a claim of ``claim_volume_name`` if it is still ``token``'s."""
        key = self._k("volume-name", name)
        if _str(await self.client.get(key) or "") == token:
            await self.client.delete(key)

    async def pin_to_volumes(self, node_id: str, *refs: str) -> None:
        """Sandboxes made from snapshot ``refs`` (its id and names) mount volumes of
        ``node_id``: creates from it go there."""
        if refs:
            await self.client.hset(self._k("volume-templates"),
                                   mapping={r: node_id for r in refs})

    async def volumes_pin(self, ref: str) -> str | None:
        """The node a create from template or snapshot ``ref`` must go to for its volumes."""
        node = await self.client.hget(self._k("volume-templates"), ref)
        return None if node is None else _str(node)

    # -- templates (written by gateways)

    async def set_template_home(self, node_id: str, *refs: str) -> None:
        """``refs`` (a template's id and aliases) were built on ``node_id``: its build,
        files and status calls go there."""
        if refs:
            await self.client.hset(self._k("templates"), mapping={r: node_id for r in refs})
            await self.add_template_node(refs[0], node_id)

    async def template_home(self, ref: str) -> str | None:
        node = await self.client.hget(self._k("templates"), ref)
        return None if node is None else _str(node)

    async def add_template_node(self, ref: str, node_id: str) -> None:
        """``node_id`` holds template ``ref`` (built or started it there): creates from it
        prefer that node."""
        await self.client.sadd(self._k("template", ref, "nodes"), node_id)

    async def template_nodes(self, ref: str) -> set[str]:
        return _strs(await self.client.smembers(self._k("template", ref, "nodes")))

    async def node_sandboxes(self, node_id: str) -> set[str]:
        return _strs(await self.client.smembers(
            self._k("node", node_id, "sandboxes")))

    async def forget(self, node_id: str) -> None:
        """Remove a node and its share of the index (an operator's clean-up)."""
        ids = await self.node_sandboxes(node_id)
        async with self.client.pipeline(transaction=True) as p:
            if ids:
                p.hdel(self._k("sandboxes"), *ids)
                p.srem(self._k("autoresume"), *ids)
            p.delete(self._k("node", node_id, "sandboxes"), self._k("alive", node_id))
            p.hdel(self._k("nodes"), node_id)
            await p.execute()
        old = {_str(k): _str(v) for k, v in
               (await self.client.hgetall(self._k("node", node_id, "volumes"))).items()}
        async with self.client.pipeline(transaction=True) as p:
            self._volumes(p, node_id, old, {})
            await p.execute()


def _str(v: bytes | str) -> str:
    """A reply as text (the client decodes replies; typeshed cannot know it)."""
    return v.decode() if isinstance(v, bytes) else v


def _strs(values: Iterable[bytes | str]) -> set[str]:
    return {_str(v) for v in values}
