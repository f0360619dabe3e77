"""A node's ``NodeAgent`` from its settings and store: who it says it is, what it publishes.

The node's id is ``AENV_NODE_ID`` (default: the host name), its URL ``AENV_ADVERTISE_URL``
(default: its listener's, which must then not be a wildcard address). It publishes every
live sandbox of its store (``LIVE_STATES``: running, paused, fork children, those
starting or stopping), counted as running while it holds a VM (``VM_STATES``), and with
its record its budgets (``Capacity``: the same limits its admission applies, the start
queue's bound among them) and what those sandboxes, and the creates waiting in its start
queue, use of them, so gateways send creates only where they fit or can wait; and its
volumes, so that gateways route a volume's calls, and the creates that mount it, here. A
paused sandbox that mounts volumes is not offered to other nodes: its volumes live here.
A node with a shared store publishes no volumes but ``shared_volumes`` in its record:
its volumes are in the shared store, and any such node serves them; a paused sandbox
whose volumes are all there is offered like one without volumes.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..config import Settings
from ..storage import shared_store, shared_volumes
from ..store import VM_STATES, SandboxRecord, SandboxState, SandboxStore
from .handover import Handover
from .node_agent import NodeAgent
from .registry import IndexEntry, NodeRecord, Registry, Usage

# A heartbeat's index reads whether another node took a paused sandbox at most this often
# (two shared-store reads per paused sandbox: costly on NFS with many); a publish reads it
# afresh (``NodeAgent.fresh_index``), so a stale answer never routes one back here.
MOVED_CHECK_S = 10.0
# States of a sandbox getting its VM: what a node's ``max_starting`` counts.
STARTING_STATES = (SandboxState.CREATING, SandboxState.RESUMING)


@dataclass(frozen=True)
class Capacity:
    """A node's budgets as its admission applies them (0: no limit): sandboxes holding a
    VM, sandboxes starting at once, guest vCPUs and memory (host totals x overcommit); and
    the creates it queues behind ``max_starting`` (0: none)."""

    max_sandboxes: int = 0
    max_starting: int = 0
    start_queue: int = 0
    vcpus: int = 0
    memory_mb: int = 0


def capacity_of(settings: Settings) -> Capacity:
    """The budgets ``aenv server`` admits with (``ServerOptions.from_settings``): host
    cores and RAM times the settings' overcommit."""
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    return Capacity(max_sandboxes=settings.max_sandboxes, max_starting=settings.max_starting,
                    start_queue=settings.start_queue,
                    vcpus=int((os.cpu_count() or 1) * settings.cpu_overcommit),
                    memory_mb=int(memory_mb * settings.memory_overcommit))


def usage_of(sandboxes: SandboxStore,
             queued: Callable[[], Sequence[tuple[int, int]]] = tuple) -> Callable[[], Usage]:
    """What the node's sandboxes use of its budgets, read from its store, and the creates
    waiting in its start queue (``queued``: their (vCPUs, MiB), ``StartQueue.queued_sizes``),
    as admission counts them: every sandbox holding a VM, and every queued create as if it
    ran."""

    def usage() -> Usage:
        held = sandboxes.in_states(VM_STATES)
        waiting = list(queued())
        return Usage(starting=sum(r.state in STARTING_STATES for r in held),
                     queued=len(waiting),
                     vcpus_used=sum(r.cpu_count for r in held) + sum(c for c, _ in waiting),
                     memory_used_mb=sum(r.memory_mb for r in held)
                     + sum(m for _, m in waiting))

    return usage


class NodeSetupError(ValueError):
    """The settings do not make a node that a gateway can reach; the message says why."""


def node_id(settings: Settings) -> str:
    return settings.node_id or socket.gethostname().split(".")[0]


def advertise_url(settings: Settings) -> str:
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.listen_host
    if host in ("0.0.0.0", "::", ""):
        raise NodeSetupError(f"the listener is on the wildcard address {host!r}: say where "
                             "gateways reach this node with --advertise / AENV_ADVERTISE_URL")
    scheme = "https" if settings.tls_cert or settings.tls_self_signed else "http"
    where = f"[{host}]" if ":" in host else host
    return f"{scheme}://{where}:{settings.listen_port}"


def restores(settings: Settings) -> dict[str, Any]:
    """What snapshots this node can restore (``shared_store.node_capabilities``), for the
    gateway; the guest kernels are left to the node's own check at restore."""
    from ..runtime.kvm import host_accel

    accel = "kvm" if settings.runtime == "firecracker" else host_accel().accel
    offers = shared_store.node_capabilities(settings.runtime, accel, [])
    del offers["kernels"]
    return offers


def check(settings: Settings) -> None:
    """Raise ``NodeSetupError`` when cluster mode lacks what it needs."""
    if not settings.cluster:
        return
    if not settings.cluster_secret:
        raise NodeSetupError("--cluster needs AENV_CLUSTER_SECRET (the secret gateways "
                             "send; the same on every node and gateway)")
    advertise_url(settings)


def node_agent(settings: Settings, sandboxes: SandboxStore,
               capacity: Capacity | None = None,
               queued: Callable[[], Sequence[tuple[int, int]]] = tuple,
               volumes: Callable[[], dict[str, str]] | None = None) -> NodeAgent:
    """``capacity`` None: ``capacity_of(settings)``; ``queued``: the sizes of the creates
    waiting in the node's start queue (``StartQueue.queued_sizes``); ``volumes``: the
    node's volumes, id -> name (None: it publishes none)."""
    assert settings.cluster, "not in a cluster"
    check(settings)
    shared = shared_store.SharedStore(settings.shared_store) if settings.shared_store \
        else None
    cap = capacity or capacity_of(settings)
    record = NodeRecord(node_id=node_id(settings), url=advertise_url(settings),
                        version=__version__, max_sandboxes=cap.max_sandboxes,
                        max_starting=cap.max_starting, start_queue=cap.start_queue,
                        vcpus=cap.vcpus,
                        memory_mb=cap.memory_mb,
                        restores=restores(settings) if shared else {},
                        shared_volumes=shared is not None)
    requires: dict[str, str] = {}  # snapshot ref -> its requirements (snapshots never change)

    def offered(ref: str | None) -> str:
        """The requirements of published snapshot ``ref`` as JSON ("" if unpublished)."""
        if shared is None or not ref:
            return ""
        if ref not in requires:
            try:
                bundle = shared.bundle(ref.split(":", 1)[-1])
            except (shared_store.SharedStoreError, OSError):
                return ""
            requires[ref] = json.dumps(bundle.requires, sort_keys=True)
        return requires[ref]

    handover = Handover(shared, record.node_id) if shared else None
    checked: dict[tuple[str, str | None], tuple[float, bool]] = {}  # moved, until when

    def moved(r: SandboxRecord, fresh: bool) -> bool:
        """Whether another node took paused ``r`` (two reads of the shared store): read
        again at most every ``MOVED_CHECK_S``, or when ``fresh``."""
        key, now = (r.id, r.snapshot_id), time.monotonic()
        hit = checked.get(key)
        if fresh or hit is None or hit[0] <= now:
            assert handover is not None
            hit = checked[key] = (now + MOVED_CHECK_S, handover.moved(r))
        return hit[1]

    in_store: dict[str, bool] = {}  # volume id -> in the shared store (never changes)

    def portable(r: SandboxRecord) -> bool:
        """Whether every volume ``r`` mounts is a shared one (any node serves it)."""
        for m in r.volume_mounts or ():
            vid = m.get("volumeID", "")
            if vid not in in_store:
                try:
                    in_store[vid] = settings.shared_store is not None and \
                        shared_volumes.root_in(settings.shared_store, vid).is_dir()
                except (shared_volumes.SharedVolumeError, OSError):
                    in_store[vid] = False
            if not in_store[vid]:
                return False
        return True

    def entries(fresh: bool) -> list[IndexEntry]:
        # A paused sandbox another node took is not published, even before the orchestrator
        # forgets it (``drop_moved``): it would route the sandbox back here.
        live = sandboxes.live()
        paused = {(r.id, r.snapshot_id) for r in live if r.state == SandboxState.PAUSED}
        for gone in [k for k in checked if k not in paused]:
            del checked[gone]
        return [IndexEntry(r.id, r.state in VM_STATES,
                           offered(r.snapshot_id)
                           if r.state == SandboxState.PAUSED and portable(r) else "",
                           auto_resume=r.auto_resume and r.state == SandboxState.PAUSED
                           and portable(r))
                for r in live
                if handover is None or r.state != SandboxState.PAUSED
                or not moved(r, fresh)]

    return NodeAgent(Registry.from_url(settings.cluster), record, lambda: entries(False),
                     usage_of(sandboxes, queued), fresh_index=lambda: entries(True),
                     volumes=volumes)
