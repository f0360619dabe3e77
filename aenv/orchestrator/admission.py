"""Admission control: whether one more sandbox (or a pause) fits on this node.

Checked before anything is made, so a request that does not fit costs nothing and gets a
clear answer: 400 for a sandbox larger than any this node runs (``Budget`` maxima), 429
when the node is full (vCPUs and memory over the host's, times a configurable overcommit;
free space for guest RAM files of cold boots; free disk in ``AENV_HOME``), 507 for a pause
that would not have room for its snapshot. Creates waiting for a start
(``start_queue``) count against the budget as if they ran, so a burst is refused at once
when it could not fit, not after its wait. VMs that no sandbox record holds — template
builds, the base template's snapshot boot — take a ``reserve`` for their lifetime and
count like sandboxes.

Overcommit is the norm for sandboxes: a restored guest shares the template's memory pages
until it writes them, and idle guests use little CPU. The defaults (vCPUs 64x the host's
cores, memory 2x its RAM) let a 2-core, 24 GiB host hold ~96 idle 1-vCPU 512 MiB
sandboxes (at 16x, 32 vCPUs refused half of a burst of 64 creates from base); lower them
where guests are busy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..store import SandboxRecord
from .errors import InsufficientStorage, InvalidRequest, LimitReached
from .machine import NodeResources


@dataclass(frozen=True)
class Budget:
    cpu_overcommit: float = 64.0
    memory_overcommit: float = 2.0
    # Kept free in AENV_HOME for the store, logs and snapshot manifests.
    disk_reserve_mb: int = 1024
    max_cpu_per_sandbox: int = 8
    max_memory_mb_per_sandbox: int = 16384
    max_disk_mb_per_sandbox: int = 65536


@dataclass(frozen=True)
class Ask:
    """What a start needs: ``count`` sandboxes of this size; ``cold`` boots map a RAM
    file of their own (restores map the snapshot's)."""

    cpus: int
    memory_mb: int
    count: int = 1
    cold: bool = False


class Admission:
    """``resources``: the host's totals and free space now; ``running``: the records that
    hold a VM now."""

    def __init__(self, budget: Budget, resources: Callable[[], NodeResources],
                 running: Callable[[], Iterable[SandboxRecord]]) -> None:
        self.budget = budget
        self._resources = resources
        self._running = running
        self._reserved: list[tuple[int, int]] = []

    def check_size(self, cpus: int, memory_mb: int, disk_mb: int = 0) -> None:
        """400 for a sandbox larger than this node runs at all."""
        b = self.budget
        for what, value, limit, unit in (("vCPUs", cpus, b.max_cpu_per_sandbox, ""),
                                         ("memory", memory_mb, b.max_memory_mb_per_sandbox,
                                          " MiB"),
                                         ("disk", disk_mb, b.max_disk_mb_per_sandbox, " MiB")):
            if value > limit:
                raise InvalidRequest(f"a sandbox may have at most {limit}{unit} {what} on this "
                                     f"node ({value}{unit} asked)")

    def check_start(self, ask: Ask, queued: Iterable[tuple[int, int]] = ()) -> None:
        """429 when ``ask`` does not fit beside the VMs running and reserved and the
        creates ``queued`` ahead of it ((vCPUs, MiB) each: they will start first)."""
        res = self._resources()
        b = self.budget
        held = [(r.cpu_count, r.memory_mb) for r in self._running()] + self._reserved + \
            list(queued)
        cpus_used = sum(c for c, _ in held)
        mem_used = sum(m for _, m in held)
        cpu_cap = int(res.cpus * b.cpu_overcommit)
        mem_cap = int(res.memory_mb * b.memory_overcommit)
        if cpus_used + ask.cpus * ask.count > cpu_cap:
            raise LimitReached(
                f"this node has no room for {ask.count} x {ask.cpus} vCPUs: {cpus_used} of "
                f"{cpu_cap} in use ({res.cpus} cores x overcommit {b.cpu_overcommit:g})")
        if mem_used + ask.memory_mb * ask.count > mem_cap:
            raise LimitReached(
                f"this node has no room for {ask.count} x {ask.memory_mb} MiB: {mem_used} of "
                f"{mem_cap} MiB in use ({res.memory_mb} MiB x overcommit "
                f"{b.memory_overcommit:g})")
        if ask.cold and res.ram_file_free_mb is not None and \
                res.ram_file_free_mb < ask.memory_mb * ask.count:
            raise LimitReached(
                f"no space for guest RAM: {res.ram_file_free_mb} MiB free where booted VMs "
                f"keep it, {ask.memory_mb * ask.count} MiB needed")
        if res.disk_free_mb < b.disk_reserve_mb:
            raise LimitReached(f"the data directory has {res.disk_free_mb} MiB free, under "
                               f"the {b.disk_reserve_mb} MiB kept in reserve")

    def check_pause(self, memory_mb: int) -> None:
        """507 when a pause's snapshot (at most the guest's RAM) would not fit."""
        res = self._resources()
        need = memory_mb + self.budget.disk_reserve_mb
        if res.disk_free_mb < need:
            raise InsufficientStorage(
                f"not enough space to pause: {res.disk_free_mb} MiB free in the data "
                f"directory, {need} MiB needed (guest memory + reserve)")

    @contextlib.contextmanager
    def reserve(self, cpus: int, memory_mb: int, *, check: bool = True) -> Iterator[None]:
        """Count a VM that no sandbox record holds (a build) while the block runs;
        ``check`` False when the caller already checked (and answered) the request."""
        if check:
            self.check_start(Ask(cpus, memory_mb, cold=True))
        entry = (cpus, memory_mb)
        self._reserved.append(entry)
        try:
            yield
        finally:
            self._reserved.remove(entry)
