"""The lifecycle state machine of sandboxes on one node.

States: ``creating → running ⇄ (pausing → paused → resuming) … → killing → killed``, plus
``snapshotting`` and ``forking`` as brief detours from ``running``, and ``lost`` for a
sandbox whose VM vanished (a crash). Every change of state is a compare-and-set in the
store, and every operation on one sandbox runs under that sandbox's lock, so a pause that
arrives while a kill is in flight waits and then finds the sandbox gone, and two connects
to one paused sandbox resume it once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..store import SandboxRecord, SandboxStore, TemplateRecord, TemplateStore
from .errors import Conflict, LimitReached, SandboxNotFound, StartFailed, TemplateNotFound
from .ids import new_id, new_token
from .machine import Machines
from .timing import record_phases

log = logging.getLogger("aenv.orchestrator")

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 24 * 3600


@dataclass(frozen=True)
class Limits:
    max_sandboxes: int = 64
    max_starting: int = 8


@dataclass
class CreateOptions:
    template: str
    timeout: int = DEFAULT_TIMEOUT_S
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    secure: bool = True
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    allow_internet: bool | None = None
    network: dict[str, Any] | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    idempotency_key: str | None = None
    client_id: str = "aenv"


class Orchestrator:
    def __init__(
        self,
        sandboxes: SandboxStore,
        templates: TemplateStore,
        machines: Machines,
        *,
        limits: Limits = Limits(),
        clock: Callable[[], float] = time.time,
        ttl_interval: float = 1.0,
    ) -> None:
        self.sandboxes = sandboxes
        self.templates = templates
        self.machines = machines
        self.limits = limits
        self.clock = clock
        self.ttl_interval = ttl_interval
        self._locks: dict[str, asyncio.Lock] = {}
        self._starting = 0
        self._ttl_task: asyncio.Task | None = None
        # Called with the sandbox id after its VM stopped (kill, pause): e.g. the proxy
        # drops pooled connections to the address the VM had.
        self.on_stop: list[Callable[[str], Awaitable[None]]] = []

    # -- service life ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.recover()
        self._ttl_task = asyncio.create_task(self._ttl_loop(), name="aenv-ttl")

    async def close(self) -> None:
        if self._ttl_task:
            self._ttl_task.cancel()
            try:
                await self._ttl_task
            except asyncio.CancelledError:
                pass

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # -- queries --------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(sandbox_id)
        return rec

    def template(self, id_or_name: str) -> TemplateRecord:
        tpl = self.templates.get(id_or_name)
        if tpl is None or tpl.status != "ready":
            raise TemplateNotFound(id_or_name)
        return tpl

    # -- create ---------------------------------------------------------------------------

    async def create(self, opts: CreateOptions,
                     timings: dict[str, float] | None = None) -> SandboxRecord:
        """Make and boot a sandbox; ``timings``, when given, receives seconds per phase."""
        t_start = self.clock()
        if opts.idempotency_key:
            existing = self.sandboxes.by_idempotency_key(opts.idempotency_key)
            if existing is not None:
                return existing
        tpl = self.template(opts.template)
        live = self.sandboxes.count(("creating", "running", "resuming", "forking",
                                     "snapshotting", "pausing"))
        if live >= self.limits.max_sandboxes:
            raise LimitReached(
                f"this node runs its maximum of {self.limits.max_sandboxes} sandboxes")
        if self._starting >= self.limits.max_starting:
            raise LimitReached(
                f"{self._starting} sandboxes are starting on this node; try again shortly")
        now = self.clock()
        rec = SandboxRecord(
            id=new_id(),
            template_id=tpl.id,
            alias=tpl.names[0] if tpl.names else None,
            state="creating",
            client_id=opts.client_id,
            started_at=now,
            end_at=now + opts.timeout,
            cpu_count=opts.cpu_count or tpl.cpu_count,
            memory_mb=opts.memory_mb or tpl.memory_mb,
            disk_size_mb=tpl.disk_size_mb,
            metadata=dict(opts.metadata),
            env_vars={**tpl.env_vars, **opts.env_vars},
            envd_token=new_token() if opts.secure else None,
            traffic_token=None,
            secure=opts.secure,
            auto_pause=opts.auto_pause,
            auto_pause_memory=opts.auto_pause_memory,
            auto_resume=opts.auto_resume,
            allow_internet=opts.allow_internet,
            network=opts.network,
            idempotency_key=opts.idempotency_key,
        )
        self.sandboxes.insert(rec)
        self._starting += 1
        try:
            async with self._lock(rec.id):
                t0 = self.clock()
                try:
                    placement = await self.machines.start(rec, tpl)
                except Exception as e:
                    self._end(rec.id, "killed", f"start failed: {e}")
                    log.exception("sandbox %s: start failed", rec.id)
                    raise StartFailed(f"sandbox could not be started: {e}") from e
                now = self.clock()
                changes = dict(
                    vm_dir=placement.vm_dir, vm_pid=placement.vm_pid, slot=placement.slot,
                    host_ip=placement.host_ip, runtime=placement.runtime,
                    end_at=now + opts.timeout,
                )
                if not self.sandboxes.transition(rec.id, ["creating"], "running", **changes):
                    # Killed while starting (only possible through recovery paths).
                    await self.machines.stop(rec)
                    raise SandboxNotFound(rec.id)
                self.templates.update(tpl.id, last_spawned_at=now,
                                      spawn_count=tpl.spawn_count + 1)
                phases = {"orchestrator": self.clock() - t_start - sum(placement.phases.values()),
                          **placement.phases}
                record_phases("create", phases)
                if timings is not None:
                    timings.update(phases)
                log.info("sandbox %s: running (template %s) in %.0f ms", rec.id, tpl.id,
                         (now - t0) * 1000)
        finally:
            self._starting -= 1
        return self.get(rec.id)

    # -- kill, timeout --------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if not self.sandboxes.transition(sandbox_id, [rec.state], "killing"):
                raise SandboxNotFound(sandbox_id)
            try:
                await self.machines.stop(rec)
            finally:
                self._end(sandbox_id, "killed", "killed")
                await self._stopped(sandbox_id)
        self._locks.pop(sandbox_id, None)

    async def _stopped(self, sandbox_id: str) -> None:
        for hook in self.on_stop:
            try:
                await hook(sandbox_id)
            except Exception:
                log.exception("sandbox %s: on_stop hook failed", sandbox_id)

    def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        """TTL = now + seconds; may shorten. 0 expires at the next TTL tick."""
        self.get(sandbox_id)
        self.sandboxes.update(sandbox_id, end_at=self.clock() + seconds)

    def extend_timeout(self, sandbox_id: str, seconds: int) -> None:
        """TTL = max(current, now + seconds)."""
        rec = self.get(sandbox_id)
        self.sandboxes.update(sandbox_id, end_at=max(rec.end_at, self.clock() + seconds))

    # -- connect / pause / resume ---------------------------------------------------------

    async def connect(self, sandbox_id: str, timeout: int | None) -> tuple[SandboxRecord, bool]:
        """Running: extend the TTL if longer, return (rec, False). Paused: resume, return
        (rec, True)."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state == "paused":
                await self._resume_locked(rec, timeout)
                return self.get(sandbox_id), True
            if rec.state != "running":
                raise Conflict(f"sandbox '{sandbox_id}' is {rec.state}")
        if timeout is not None:
            self.extend_timeout(sandbox_id, timeout)
        return self.get(sandbox_id), False

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state == "paused":
                raise Conflict(f"sandbox '{sandbox_id}' is already paused")
            if rec.state != "running":
                raise Conflict(f"sandbox '{sandbox_id}' is {rec.state}")
            await self._pause_locked(rec, memory)

    async def resume(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state != "paused":
                raise Conflict(f"sandbox '{sandbox_id}' is already running")
            await self._resume_locked(rec, timeout)
        return self.get(sandbox_id)

    async def _pause_locked(self, rec: SandboxRecord, memory: bool) -> None:
        if not self.sandboxes.transition(rec.id, ["running"], "pausing"):
            raise Conflict(f"sandbox '{rec.id}' changed state")
        try:
            snapshot_id = await self.machines.pause(rec, memory)
        except Exception:
            self.sandboxes.transition(rec.id, ["pausing"], "running")
            raise
        await self._stopped(rec.id)
        self.sandboxes.transition(
            rec.id, ["pausing"], "paused", snapshot_id=snapshot_id,
            pause_mode="full" if memory else "filesystem", vm_pid=None, slot=None, host_ip=None,
        )

    async def _resume_locked(self, rec: SandboxRecord, timeout: int | None) -> None:
        if not self.sandboxes.transition(rec.id, ["paused"], "resuming"):
            raise Conflict(f"sandbox '{rec.id}' changed state")
        try:
            placement = await self.machines.resume(rec)
        except Exception:
            self.sandboxes.transition(rec.id, ["resuming"], "paused")
            raise
        now = self.clock()
        self.sandboxes.transition(
            rec.id, ["resuming"], "running", vm_dir=placement.vm_dir, vm_pid=placement.vm_pid,
            slot=placement.slot, host_ip=placement.host_ip, runtime=placement.runtime,
            end_at=now + (timeout if timeout is not None else DEFAULT_TIMEOUT_S),
        )

    # -- TTL ------------------------------------------------------------------------------

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_interval)
            try:
                await self.expire_once()
            except Exception:
                log.exception("TTL sweep failed")

    async def expire_once(self) -> None:
        for rec in self.sandboxes.expired(self.clock()):
            if self._lock(rec.id).locked():
                continue  # an operation is in flight; look again next tick
            try:
                if rec.auto_pause and self.machines.can_pause:
                    log.info("sandbox %s: TTL reached, pausing", rec.id)
                    async with self._lock(rec.id):
                        cur = self.sandboxes.get(rec.id)
                        if cur and cur.state == "running" and cur.end_at <= self.clock():
                            await self._pause_locked(cur, rec.auto_pause_memory)
                else:
                    log.info("sandbox %s: TTL reached, killing", rec.id)
                    await self.kill(rec.id)
            except SandboxNotFound:
                pass
            except Exception:
                log.exception("sandbox %s: TTL action failed", rec.id)

    # -- recovery -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Reconcile the store with what survived a restart: adopt running VMs, finish
        interrupted kills, report the rest lost. Paused sandboxes need nothing."""
        for rec in self.sandboxes.live():
            if rec.state == "paused":
                continue
            if rec.state == "running" and await self.machines.reattach(rec):
                log.info("sandbox %s: re-attached after restart", rec.id)
                continue
            await self.machines.stop(rec)
            if rec.state == "killing":
                self._end(rec.id, "killed", "killed")
            elif rec.state in ("pausing", "resuming") and rec.snapshot_id:
                # The snapshot it paused to, or resumed from, is intact: back to paused.
                self.sandboxes.transition(rec.id, [rec.state], "paused", vm_pid=None,
                                          slot=None, host_ip=None)
            else:
                self._end(rec.id, "lost", f"VM gone after server restart (was {rec.state})")
                log.warning("sandbox %s: lost after restart (was %s)", rec.id, rec.state)

    def _end(self, sandbox_id: str, state: str, reason: str) -> None:
        rec = self.sandboxes.get(sandbox_id, live_only=False)
        if rec is not None:
            self.sandboxes.transition(sandbox_id, [rec.state], state, reason=reason,
                                      ended_at=self.clock(), vm_pid=None)
