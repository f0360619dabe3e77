"""The seam between lifecycle decisions and the host: what it takes to run one sandbox.

``Machines`` makes and unmakes the VM behind a sandbox record — network slot, disk, VMM,
envd ready and initialised. The orchestrator calls it under the sandbox's lock and records
the result; tests of the lifecycle can stand in a fake here without touching the host.
``NodeMachines`` (``node``) is the implementation with real VMs. (A "machine record" in
``aenv.runtime`` is something else: the shape of one VM, kept in its ``vm.json``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..store import SandboxRecord, TemplateRecord


@dataclass(frozen=True)
class Placement:
    """Where a running sandbox lives on this node (all of it goes into the store)."""

    vm_dir: str
    vm_pid: int
    slot: int
    host_ip: str
    runtime: str
    # Where the time went, seconds per phase (e.g. slot, disk, vmm, kernel, init, envd).
    phases: dict[str, float] = field(default_factory=dict)
    # The snapshot the VM was restored from: it must live as long as this VM does.
    restored_from: str | None = None


@dataclass(frozen=True)
class NodeResources:
    """The host's totals and its free space now (what admission control weighs)."""

    cpus: int
    memory_mb: int
    disk_free_mb: int  # in AENV_HOME: snapshots, disks, the store
    # Free space where booted VMs keep their guest RAM file (tmpfs); None: not in a file.
    ram_file_free_mb: int | None = None


class Machines(Protocol):
    #: Whether ``pause``/``resume`` work on this node (TTL expiry kills otherwise).
    can_pause: bool

    def image_key(self) -> str | None:
        """What the node's base image is made of (its digest); None when there is none."""

    def resources(self) -> NodeResources:
        """Host totals and free space, read now (cheap: a few statvfs calls)."""

    async def prepare(self, keep_slots: set[int], keep_vms: set[str]) -> None:
        """Get the node ready before recovery: host resources, leftovers of a crashed run
        removed except what sandboxes that may be re-attached still use."""

    async def close(self) -> None:
        """The server stops; running VMs are left running for the next start to adopt."""

    async def start(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
        """Boot a VM for ``rec`` — or restore one, when ``template.image`` names a snapshot
        (``template.envd_token`` is the token inside it) — and return once envd answered
        ``/init``. On failure everything made so far is released before raising."""

    async def stop(self, rec: SandboxRecord) -> None:
        """Stop the VM and release its slot and disk. Idempotent; never raises for
        things already gone."""

    async def reattach(self, rec: SandboxRecord) -> bool:
        """After a server restart: adopt the VM still running for ``rec``. False when it
        is gone or unusable (the caller then stops it and reports it lost)."""

    async def pause(self, rec: SandboxRecord, memory: bool,
                    ref: str) -> dict[str, float] | None:
        """Save the sandbox as snapshot ``ref`` — memory, devices and disk, or with
        ``memory`` false the disk alone (resuming it boots) — then stop its VM and release
        its slot. Resuming is ``start`` with a template whose image is ``ref``. On failure
        either ``ref`` is complete (only the VM's end failed) or it does not exist and the
        VM runs on as before — unless the VM itself died; the disk is never lost.
        ``ref`` is durable (fsynced) once complete. Returns where the time went (seconds
        per phase, accounting for all of the call), or None when the machines do not
        say."""

    async def snapshot(self, rec: SandboxRecord, ref: str) -> dict[str, float] | None:
        """Capture the running sandbox as ``ref`` (vCPUs frozen only for the capture; it
        runs on, and from now on its disk reads through the snapshot's). Returns where the
        time went (seconds per phase: the capture's steps and what the node added), or
        None when the machines do not say."""

    def has_snapshot(self, ref: str) -> bool:
        """Whether ``ref`` is a complete snapshot here (an interrupted pause leaves none)."""

    def is_running(self, rec: SandboxRecord) -> bool:
        """Whether this node holds a live VM for ``rec`` (after a failed pause: the drivers
        thaw the VM again unless it died)."""

    async def update_network(self, rec: SandboxRecord) -> None:
        """Apply ``rec``'s egress policy (``network``, ``allow_internet``) to its running VM
        at once; raises ``InvalidRequest`` for a policy that does not parse."""

    async def collect(self, roots: Callable[[], set[str]]) -> int:
        """Delete every snapshot and layer that neither is in ``roots()`` nor is depended on
        by one that is; returns how many were deleted. ``roots`` is called while snapshot
        writes are held off, so a snapshot committed before the call is always seen. When a
        dependency cannot be read, nothing is deleted (fail closed)."""

    async def commit(self, rec: SandboxRecord, ref: str) -> None:
        """Stop the (build) VM of ``rec`` and keep its root disk as the new read-only layer
        ``ref`` (``layer:<id>``, pinned by the caller) over its template's."""

    def logs(self, rec: SandboxRecord, start: int | None,
             limit: int) -> list[dict[str, Any]]:
        """Console lines of the sandbox's VM: ``[{"timestamp": ms, "line": str}]``."""
