"""A node's membership in a cluster: heartbeat, and its sandbox index published to Redis.

``NodeAgent`` reads what to publish from the node's own store (``index``, a callable: the
live sandboxes, running and paused, fork children included) and writes it with
``Registry.publish``, with what the node uses of its budgets (``usage``: vCPUs, memory,
sandboxes starting) in its record, and its volumes (``volumes``: id -> name), which live
on this node only. It publishes:

- on ``start``;
- on ``sync()``, which ``PublishAfterChange`` awaits before a successful create, kill,
  pause, resume, connect or fork answers (and a volume's create or delete), so a client
  that got the answer (through a gateway) finds the sandbox or volume routed;
- on every heartbeat (every TTL/3) when the index or the usage differs from the last one
  published (TTL kills and auto-pauses happen without a request), and when the node's liveness key
  had vanished (Redis restarted empty): the store is the truth, Redis an index of it.

Redis being down never fails a request or the node: errors are logged (once per outage)
and the next heartbeat tries again. ``drain`` marks the node ``draining`` (kept in every
later publish until ``ready``): gateways send it no new creates, its sandboxes stay
routed.
``close`` takes the node out of scheduling and routing at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .registry import IndexEntry, NodeRecord, Registry, Usage

log = logging.getLogger("aenv.cluster")

SYNC_TIMEOUT_S = 2.0
# REST calls after which the node's index changes: creates, kills, pauses, resumes, forks.
_CHANGES = re.compile(
    r"^(?:(?:/v2)?/sandboxes(?:/[^/]+(?:/(?:pause|resume|connect|fork))?)?"
    r"|/volumes(?:/[^/]+)?)/?$")


class NodeAgent:
    def __init__(self, registry: Registry, record: NodeRecord,
                 index: Callable[[], list[IndexEntry]],
                 usage: Callable[[], Usage] | None = None,
                 fresh_index: Callable[[], list[IndexEntry]] | None = None,
                 volumes: Callable[[], dict[str, str]] | None = None) -> None:
        self.registry = registry
        self.record = record          # id, URL, version, capacity; counts filled per publish
        self.index = index
        # What is published, when ``index`` may answer from a cache (``node_setup``): read
        # afresh only when a publish is due.
        self.fresh_index = fresh_index
        self.usage = usage or Usage
        self.volumes = volumes
        self._lock = asyncio.Lock()
        self._published: tuple[frozenset[IndexEntry], Usage,
                               frozenset[tuple[str, str]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.stopping = False

    @property
    def interval(self) -> float:
        return self.registry.ttl_s / 3

    async def start(self) -> None:
        await self.sync()
        self._task = asyncio.create_task(self._beat(), name="cluster-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await asyncio.wait_for(self.registry.leave(self.record.node_id), SYNC_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("cluster: could not leave the registry: %s", e)
        await self.registry.close()

    @property
    def draining(self) -> bool:
        return self.record.draining

    async def drain(self, *, stopping: bool = False) -> bool:
        """Draining from now on (a SIGTERM, a preStop): published at once; False if Redis
        failed (the next heartbeat publishes it). ``stopping``: the node stops once
        drained (SIGTERM), and no ``ready`` takes that back."""
        self.stopping = self.stopping or stopping
        if not self.record.draining:
            log.info("cluster: node %s draining: no new creates", self.record.node_id)
            self.record = replace(self.record, draining=True)
        return await self.sync()

    async def ready(self) -> bool:
        """Take new creates again after a ``drain`` (an operator's un-drain); published at
        once. Not while the node is stopping."""
        if self.stopping:
            raise RuntimeError("the node is stopping (SIGTERM): it drains until it stops")
        if self.record.draining:
            log.info("cluster: node %s ready again: takes new creates", self.record.node_id)
            self.record = replace(self.record, draining=False)
        return await self.sync()

    async def sync(self, *, force: bool = True) -> bool:
        """Publish the store's index (when ``force`` or changed); False if Redis failed."""
        async with self._lock:
            entries = frozenset(self.index())
            usage = self.usage()
            volumes = self.volumes() if self.volumes is not None else None
            held = frozenset((volumes or {}).items())
            if not force and (entries, usage, held) == self._published:
                return True
            if self.fresh_index is not None:
                entries = frozenset(self.fresh_index())
            record = replace(self.record, running=sum(e.running for e in entries),
                             paused=sum(not e.running for e in entries),
                             starting=usage.starting, queued=usage.queued,
                             vcpus_used=usage.vcpus_used,
                             memory_used_mb=usage.memory_used_mb, published_at=time.time())
            try:
                await asyncio.wait_for(self.registry.publish(record, entries, volumes),
                                       SYNC_TIMEOUT_S)
            except (RedisError, OSError, TimeoutError) as e:
                self._published = None
                self._report(e)
                return False
            self._published = (entries, usage, held)
            if self._failing:
                log.info("cluster: Redis reachable again; index of %d sandboxes published",
                         len(entries))
                self._failing = False
            return True

    def _report(self, error: Exception) -> None:
        if not self._failing:
            log.warning("cluster: Redis unreachable (%s: %s); retrying every %.1f s",
                        type(error).__name__, error, self.interval)
            self._failing = True

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                known = await asyncio.wait_for(
                    self.registry.heartbeat(self.record.node_id), SYNC_TIMEOUT_S)
            except (RedisError, OSError, TimeoutError) as e:
                self._published = None
                self._report(e)
                continue
            if not known:
                log.info("cluster: node %s was not registered (Redis restarted empty?): "
                         "publishing again", self.record.node_id)
            await self.sync(force=not known)


class PublishAfterChange:
    """ASGI wrapper of a node's REST API: after a successful call that changes the node's
    sandboxes, publish the index before the answer goes out."""

    def __init__(self, app: ASGIApp, agent: NodeAgent) -> None:
        self.app, self.agent = app, agent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] not in ("POST", "DELETE")
                or not _CHANGES.match(scope["path"])):
            return await self.app(scope, receive, send)

        async def publishing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                await self.agent.sync()
            await send(message)

        await self.app(scope, receive, publishing_send)
