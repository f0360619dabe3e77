"""The lifecycle state machine of sandboxes on one node.

States: ``creating → running ⇄ (pausing → paused → resuming) … → killing → killed``, plus
``snapshotting`` and ``forking`` as brief detours from ``running``, and ``lost`` for a
sandbox whose VM vanished (a crash); ``store.states`` has them as ``SandboxState`` and the
one table of changes between them (``TRANSITIONS``), which the store enforces: a change
not in it raises ``IllegalTransition``. Every change of state is a compare-and-set in the
store, and every operation on one sandbox runs under that sandbox's lock, so a pause that
arrives while a kill is in flight waits and then finds the sandbox gone, and two connects
to one paused sandbox resume it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..cluster.handover import Handover, Offer, SharedTemplates
from ..storage.image_ref import ImageRef
from ..storage.shared_volumes import SharedVolumes
from ..store import (
    VM_STATES,
    BuildStatus,
    SandboxRecord,
    SandboxState,
    SandboxStore,
    TemplateKind,
    TemplateRecord,
    TemplateStore,
)
from ..store.templates import NameTaken
from .admission import Admission, Ask, Budget
from .errors import (
    Conflict,
    InvalidRequest,
    LimitReached,
    NotRestorable,
    SandboxNotFound,
    StartFailed,
    TemplateNotFound,
    Unsupported,
)
from .ids import new_id, new_snapshot_ref, new_token
from .machine import Machines, Placement
from .pins import Pins
from .start_queue import StartQueue
from .template_records import (
    BASE_TEMPLATE,
    base_image_boot,
    fork_source,
    persistent_snapshot,
    resume_source,
)
from .timing import PhaseTimer, record_phases

log = logging.getLogger("aenv.orchestrator")

DEFAULT_TIMEOUT_S = 300
PURGE_INTERVAL_S = 3600
# Options of a sandbox's network fixed at create; an update replaces everything else.
_CREATE_ONLY_NETWORK = ("allowPublicTraffic", "maskRequestHost", "httpsPorts")
MAX_TIMEOUT_S = 24 * 3600
# States whose VM a restart may find alive (a capture or pause under way): re-attached,
# such a sandbox runs on.
_REATTACHABLE = (SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.FORKING,
                 SandboxState.PAUSING)


@dataclass(frozen=True)
class Limits:
    max_sandboxes: int = 64
    max_starting: int = 8
    max_fork: int = 16
    # Creates waiting for one of the max_starting starts (start_queue.py), and for how long.
    start_queue: int = 256
    start_queue_timeout_s: float = 30.0
    # Killed and lost sandboxes are forgotten this long after they ended.
    retention_s: float = 24 * 3600


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
    # [{name, path, volumeID}], resolved by ``volumes.Volumes.resolve_mounts``.
    volume_mounts: list[dict[str, str]] | None = None
    # Whether the client went away (the API's ``Request.is_disconnected``): a create that
    # waits in the start queue leaves it then.
    client_gone: Callable[[], Awaitable[bool]] | None = None


class Orchestrator:
    def __init__(
        self,
        sandboxes: SandboxStore,
        templates: TemplateStore,
        machines: Machines,
        *,
        limits: Limits = Limits(),
        budget: Budget = Budget(),
        clock: Callable[[], float] = time.time,
        ttl_interval: float = 1.0,
    ) -> None:
        self.sandboxes = sandboxes
        self.templates = templates
        self.machines = machines
        self.limits = limits
        # Shared with the builder, whose VMs count too.
        self.admission = Admission(budget, machines.resources,
                                   lambda: self.sandboxes.in_states(VM_STATES))
        self._purged_at = 0.0
        self.clock = clock
        self.ttl_interval = ttl_interval
        self._locks: dict[str, asyncio.Lock] = {}
        self._starting = 0
        self.start_queue = StartQueue(limits.max_starting, limits.start_queue,
                                      limits.start_queue_timeout_s)
        self._ttl_task: asyncio.Task[None] | None = None
        # Garbage collection off a request's path (``_collect_soon``), one at a time.
        self._collecting: asyncio.Task[None] | None = None
        self._collect_again = False
        # References in use that no record names yet (see ``pins``); the builder shares it.
        self.pins = Pins()
        # Called with the sandbox id after its VM stopped (kill, pause): e.g. the proxy
        # drops pooled connections to the address the VM had.
        self.on_stop: list[Callable[[str], Awaitable[None]]] = []
        # With volumes in the shared store: where a shared persistent snapshot's volume
        # mounts are kept, for the nodes that lack its source's record.
        self.shared_volumes: SharedVolumes | None = None

    # -- service life ---------------------------------------------------------------------

    async def start(self) -> None:
        await self.recover()
        self.drop_moved()
        self._ttl_task = asyncio.create_task(self._ttl_loop(), name="aenv-ttl")

    async def close(self) -> None:
        for task in (self._ttl_task, self._collecting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _collect_soon(self) -> None:
        """Collect garbage in the background: what a request left for collection without
        having to wait for it (a resume: its pause's snapshots). Requests that
        come while one runs are folded into one more pass."""
        if self._collecting is not None and not self._collecting.done():
            self._collect_again = True
            return
        self._collecting = asyncio.create_task(self._collect_passes(), name="aenv-collect")

    async def _collect_passes(self) -> None:
        while True:
            self._collect_again = False
            await self.collect_garbage()
            if not self._collect_again:
                return

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
        if tpl is None:
            tpl = self._import_template(id_or_name)
        if tpl is None or tpl.status != BuildStatus.READY:
            raise TemplateNotFound(id_or_name)
        return tpl

    # -- create ---------------------------------------------------------------------------

    async def create(self, opts: CreateOptions,
                     timings: dict[str, float] | None = None) -> SandboxRecord:
        """Make and boot a sandbox; ``timings``, when given, receives seconds per phase."""
        timer = PhaseTimer(self.clock)
        if opts.idempotency_key:
            existing = self.sandboxes.by_idempotency_key(opts.idempotency_key)
            if existing is not None:
                return existing
        tpl = self.template(opts.template)
        rec = self._new_record(tpl, opts)
        self.admission.check_size(rec.cpu_count, rec.memory_mb, rec.disk_size_mb)
        queue = self.start_queue
        # Refused at once when the node could not hold it even after the queue ahead of it
        # started; otherwise it waits its turn behind max_starting (start_queue.py).
        self._check_capacity(1 + queue.waiting, starts=False)
        ask = Ask(rec.cpu_count, rec.memory_mb, cold=self._cold(tpl))
        self.admission.check_start(ask, queue.queued_sizes())
        async with queue.turn((rec.cpu_count, rec.memory_mb), gone=opts.client_gone) as waited:
            if waited:
                timer.add({"queue": waited})
                if opts.idempotency_key:  # its twin may have been ahead in the queue
                    existing = self.sandboxes.by_idempotency_key(opts.idempotency_key)
                    if existing is not None:
                        return existing
                # Checked again: what ran meanwhile may have filled the node.
                self._check_capacity(1, starts=False)
                self.admission.check_start(ask)
            self.sandboxes.insert(rec)  # no await since the checks: they still hold
            timer.add(await self._start(rec, tpl, opts.timeout))  # the machines' phases
        timer.remainder("orchestrator")
        record_phases("create", timer.phases)
        if timings is not None:
            timings.update(timer.phases)
        return self.get(rec.id)

    def _cold(self, tpl: TemplateRecord) -> bool:
        """Whether a start from ``tpl`` boots (a RAM file of its own) or restores."""
        image = ImageRef.parse(tpl.image)
        return not (image.is_snapshot and self.machines.has_snapshot(str(image)))

    def _check_capacity(self, n: int, *, starts: bool = True) -> None:
        live = self.sandboxes.count(VM_STATES)
        if live + n > self.limits.max_sandboxes:
            raise LimitReached(
                f"this node runs at most {self.limits.max_sandboxes} sandboxes "
                f"({live} now, {n} more asked)")
        if starts and self._starting >= self.limits.max_starting:
            raise LimitReached(
                f"{self._starting} sandboxes are starting on this node; try again shortly")

    def _new_record(self, tpl: TemplateRecord, opts: CreateOptions) -> SandboxRecord:
        now = whole_microseconds(self.clock())
        return SandboxRecord(
            id=new_id(),
            template_id=tpl.id,
            alias=tpl.names[0] if tpl.names else None,
            state=SandboxState.CREATING,
            client_id=opts.client_id,
            started_at=now,
            end_at=now + opts.timeout,
            cpu_count=opts.cpu_count or tpl.cpu_count,
            memory_mb=opts.memory_mb or tpl.memory_mb,
            disk_size_mb=tpl.disk_size_mb,
            metadata=dict(opts.metadata),
            env_vars={**tpl.env_vars, **opts.env_vars},
            envd_token=new_token() if opts.secure else None,
            # Private sandboxes (network.allowPublicTraffic false) take a second token on
            # every request to their ports other than envd's.
            traffic_token=new_token() if (opts.network or {}).get("allowPublicTraffic") is False
            else None,
            secure=opts.secure,
            auto_pause=opts.auto_pause,
            auto_pause_memory=opts.auto_pause_memory,
            auto_resume=opts.auto_resume,
            allow_internet=opts.allow_internet,
            network=opts.network,
            idempotency_key=opts.idempotency_key,
            volume_mounts=opts.volume_mounts or self._snapshot_mounts(tpl),
        )

    def _snapshot_mounts(self, tpl: TemplateRecord) -> list[dict[str, str]] | None:
        """A persistent snapshot's guest has its source's volumes mounted: sandboxes made
        from it mount them too (while the source's record is kept), or its NFS mounts
        would hang on a namespace with no server."""
        if tpl.kind is not TemplateKind.SNAPSHOT or not tpl.source_sandbox:
            return None
        src = self.sandboxes.get(tpl.source_sandbox, live_only=False)
        if src is None and self.shared_volumes is not None:  # made on another node
            return self.shared_volumes.snapshot_mounts(tpl.id)
        return src.volume_mounts if src is not None else None

    async def _start(self, rec: SandboxRecord, tpl: TemplateRecord,
                     timeout: int) -> dict[str, float]:
        """Boot or restore the inserted record ``rec``; returns the machines' phases."""
        self._starting += 1
        try:
            async with self._lock(rec.id):
                try:
                    # The image is read for the whole start, even if its template is
                    # deleted meanwhile.
                    with self.pins.hold(tpl.image):
                        placement = await self.machines.start(rec, tpl)
                except Exception as e:
                    self._end(rec.id, SandboxState.KILLED, f"start failed: {e}")
                    log.exception("sandbox %s: start failed", rec.id)
                    raise StartFailed(f"sandbox could not be started: {e}") from e
                now = self.clock()
                if not self.sandboxes.transition(
                        rec.id, [SandboxState.CREATING], SandboxState.RUNNING,
                        **_placed(placement), end_at=now + timeout):
                    await self.machines.stop(rec)
                    raise SandboxNotFound(rec.id)
                self.templates.update(tpl.id, last_spawned_at=now,
                                      spawn_count=tpl.spawn_count + 1)
                log.info("sandbox %s: running (template %s)", rec.id, tpl.id)
                return dict(placement.phases)
        finally:
            self._starting -= 1

    # -- snapshots and forks --------------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None = None,
                       timings: dict[str, float] | None = None) -> TemplateRecord:
        """A persistent snapshot of a running sandbox, kept as a template of kind
        ``snapshot``; the source keeps running. ``timings`` receives where the request's
        time went here, phase by phase in the order they ran: ``checks`` (the name),
        ``sandbox_lock`` (waiting for another operation on the sandbox), ``store_begin``
        (its record to ``snapshotting``), the machines' phases (``NodeMachines.snapshot``:
        ``lock``, the capture's steps, ``compaction_queue``, ``log``, ``publish``; a
        capture step's finer phases, ``plan_*``, ``memory_*``, ``commit_compact`` and
        ``commit_durable``, lie within ``plan``, ``save_memory`` and ``commit``),
        ``store_end`` (its record back to ``running``),
        ``store_insert`` (the snapshot's record) and ``share`` (the cluster's shelf)."""
        timer = PhaseTimer()
        taken = self.templates.get(name) if name else None
        if taken is not None:
            # Refused before the capture, which would otherwise be left for collection.
            raise Conflict(f"name '{name}' is already used by template {taken.id}")
        ref = new_snapshot_ref()
        with self.pins.hold(ref):
            timer.mark("checks")
            async with self._lock(sandbox_id):
                timer.mark("sandbox_lock")
                rec = self.get(sandbox_id)
                await self._capture(rec, SandboxState.SNAPSHOTTING, ref, timer)
            made = self._insert_snapshot(rec, ref, name, timer)
        if timings is not None:
            timings.update(timer.phases)
        return made

    def _insert_snapshot(self, rec: SandboxRecord, ref: str, name: str | None,
                         timer: PhaseTimer | None = None) -> TemplateRecord:
        now = self.clock()
        snap_id = new_id()
        snap = persistent_snapshot(snap_id, rec, self.templates.get(rec.template_id), ref,
                                   name=name, now=now)
        self.templates.insert(snap)
        made = self.templates.get(snap_id) or snap
        if timer is not None:
            timer.mark("store_insert")
        self._share_template(made)
        if timer is not None:
            timer.mark("share")
        return made

    async def _capture(self, rec: SandboxRecord, state: SandboxState, ref: str,
                       timer: PhaseTimer | None = None) -> None:
        """Freeze-capture-thaw ``rec`` (its lock held) through ``state`` into ``ref``
        (pinned by the caller). ``timer``, when given, gets ``store_begin``, the machines'
        phases and ``store_end`` (see ``snapshot``)."""
        if rec.state != SandboxState.RUNNING:
            raise Conflict(f"sandbox '{rec.id}' is {rec.state}, not running")
        if not self.machines.can_pause:
            raise Unsupported("this node cannot snapshot sandboxes")
        self.admission.check_pause(rec.memory_mb)
        if not self.sandboxes.transition(rec.id, [SandboxState.RUNNING], state):
            raise Conflict(f"sandbox '{rec.id}' changed state")
        if timer is not None:
            timer.mark("store_begin")
        whole = PhaseTimer(self.clock)
        try:
            phases = await self.machines.snapshot(rec, ref)
        except Exception:
            self.sandboxes.transition(rec.id, [state], SandboxState.RUNNING)
            raise
        whole.mark("total")
        record_phases(state, whole.phases)
        if timer is not None:
            if phases:  # the machines account for all of their time
                timer.skip()
                timer.add(phases)
            else:  # they do not say
                timer.mark("machines")
        # The source's disk now reads through the snapshot: it keeps the snapshot alive.
        self.sandboxes.transition(rec.id, [state], SandboxState.RUNNING, restored_from=ref)
        if timer is not None:
            timer.mark("store_end")

    async def fork(self, sandbox_id: str, count: int, timeout: int | None = None,
                   timings: dict[str, float] | None = None
                   ) -> list[SandboxRecord | Exception]:
        """One capture of the running source, then ``count`` children restored from it at
        once. Each child succeeds or fails alone; the source keeps its id and TTL.
        ``timings`` receives ``capture`` and ``children`` (wall seconds) and, per phase the
        machines report for a child, its median and slowest (``restore_p50``,
        ``restore_max``, ...) over the children that started."""
        if not 1 <= count <= self.limits.max_fork:
            raise InvalidRequest(f"count must be between 1 and {self.limits.max_fork}")
        self.get(sandbox_id)
        # A fork is one request whose children start together: not held to max_starting.
        self._check_capacity(count, starts=False)
        ref = new_snapshot_ref()
        # The capture stays pinned until every child is placed: the source may be killed
        # meanwhile, and the children's records name it only once they run.
        with self.pins.hold(ref):
            return await self._fork(sandbox_id, count, ref, timeout, timings)

    async def _fork(self, sandbox_id: str, count: int, ref: str, timeout: int | None,
                    timings: dict[str, float] | None) -> list[SandboxRecord | Exception]:
        timer = PhaseTimer(self.clock)
        async with self._lock(sandbox_id):
            src = self.get(sandbox_id)
            await self._capture(src, SandboxState.FORKING, ref)
            src = self.get(sandbox_id)
        timer.mark("capture")
        # The children start from the capture; the template is only their family name.
        source = fork_source(src, self.templates.get(src.template_id), ref)
        ttl = timeout if timeout is not None else max(int(src.end_at - src.started_at), 1)
        # Checked again now that the capture is done, with no await until the inserts.
        self._check_capacity(count, starts=False)
        self.admission.check_start(Ask(src.cpu_count, src.memory_mb, count=count))
        children = []
        for _ in range(count):
            child = self._new_record(source, CreateOptions(
                template=src.template_id, timeout=ttl, metadata=src.metadata,
                env_vars=src.env_vars, secure=src.secure, auto_pause=src.auto_pause,
                auto_pause_memory=src.auto_pause_memory, auto_resume=src.auto_resume,
                allow_internet=src.allow_internet, network=src.network,
                cpu_count=src.cpu_count, memory_mb=src.memory_mb, client_id=src.client_id,
                volume_mounts=src.volume_mounts))  # the volumes themselves, not copies
            self.sandboxes.insert(child)
            children.append(child)
        timer.skip()  # the children's records are no phase
        results = await asyncio.gather(*(self._start(c, source, ttl) for c in children),
                                       return_exceptions=True)
        timer.mark("children")
        record_phases("fork", timer.phases)
        if timings is not None:
            timings.update(timer.phases)
            timings.update(_spread([r for r in results if isinstance(r, dict)]))
        out: list[SandboxRecord | Exception] = []
        for child, result in zip(children, results, strict=True):
            out.append(result if isinstance(result, Exception) else self.get(child.id))
        await self.collect_garbage()
        return out

    async def snapshot_template(self, template_id: str, key: str) -> None:
        """Boot ``template_id``'s image once and keep the running VM as its snapshot, so
        that creating from it restores instead of booting. ``key`` names what the snapshot
        was made from (e.g. the base image's digest): a snapshot of another key is made
        again."""
        tpl = self.templates.get(template_id)
        if tpl is None or not self.machines.can_pause:
            return
        if tpl.image and tpl.build_id == key and self.machines.has_snapshot(tpl.image):
            return
        with self.admission.reserve(tpl.cpu_count, tpl.memory_mb):
            await self._snapshot_template(tpl, key)

    async def _snapshot_template(self, tpl: TemplateRecord, key: str) -> None:
        now = self.clock()
        rec = SandboxRecord(
            id=new_id(), template_id=tpl.id, state=SandboxState.BUILDING, client_id="aenv-template",
            started_at=now, end_at=now + 600, cpu_count=tpl.cpu_count,
            memory_mb=tpl.memory_mb, disk_size_mb=tpl.disk_size_mb, env_vars=tpl.env_vars,
            envd_token=new_token())
        log.info("template %s: booting it once to snapshot it", tpl.id)
        timer = PhaseTimer(self.clock)
        placement = await self.machines.start(rec, base_image_boot(tpl))
        rec.vm_dir, rec.slot, rec.host_ip = placement.vm_dir, placement.slot, placement.host_ip
        ref = new_snapshot_ref()
        with self.pins.hold(ref):
            try:
                await self.machines.pause(rec, True, ref)
            except Exception:
                await self.machines.stop(rec)
                raise
            self.templates.update(tpl.id, image=ref, build_id=key, envd_token=rec.envd_token)
        if tpl.id != BASE_TEMPLATE:  # every node snapshots its own base
            made = self.templates.get(tpl.id)
            if made is not None:
                self._share_template(made)
        log.info("template %s: snapshot %s ready in %.1f s", tpl.id, ref, timer.elapsed())
        await self.collect_garbage()

    def delete_template(self, template_id: str) -> None:
        """Forget a template or snapshot; its files go once nothing uses them."""
        tpl = self.templates.get(template_id)
        if tpl is None:
            raise TemplateNotFound(template_id)
        if tpl.id == BASE_TEMPLATE:
            raise InvalidRequest(f"the built-in template '{BASE_TEMPLATE}' cannot be deleted")
        self.templates.delete(tpl.id)
        if (shelf := self.shared_templates) is not None:
            shelf.remove(tpl)
            if self.shared_volumes is not None:
                self.shared_volumes.drop_snapshot_mounts(tpl.id)

    def gc_roots(self) -> set[str]:
        """Every snapshot or layer reference something still uses: what the records name,
        and what operations in flight have pinned."""
        roots = {t.image for t in self.templates.list() if t.image}
        roots |= self.templates.tagged_images()  # older builds a tag still names
        for r in self.sandboxes.live():
            roots.update(x for x in (r.snapshot_id, r.restored_from) if x)
        return roots | self.pins.held()

    async def collect_garbage(self) -> int:
        """Delete what no root reaches. The machines ask for the roots once they hold
        their snapshot lock, so nothing committed while this waited is missed."""
        try:
            return await self.machines.collect(self.gc_roots)
        except Exception:
            log.exception("snapshot garbage collection failed")
            return 0

    # -- kill, timeout --------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if not self.sandboxes.transition(sandbox_id, [rec.state], SandboxState.KILLING):
                raise SandboxNotFound(sandbox_id)
            try:
                await self.machines.stop(rec)
            finally:
                self._end(sandbox_id, SandboxState.KILLED, "killed")
                await self._stopped(sandbox_id)
        self._locks.pop(sandbox_id, None)
        await self.collect_garbage()

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

    async def update_network(self, sandbox_id: str, egress: dict[str, Any],
                             allow_internet: bool | None) -> None:
        """Replace the running sandbox's egress configuration as a whole (what ``egress``
        leaves out is cleared), at once on its VM and in its record, so a later resume or
        fork keeps it. What cannot be updated (``allowPublicTraffic``) is kept."""
        async with self._lock(sandbox_id):
            rec = self.get(sandbox_id)
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {rec.state}; its network can be "
                               "changed while it runs")
            kept = {k: v for k, v in (rec.network or {}).items() if k in _CREATE_ONLY_NETWORK}
            network = {**kept, **egress} or None
            updated = dataclasses.replace(rec, network=network, allow_internet=allow_internet)
            await self.machines.update_network(updated)
            self.sandboxes.update(sandbox_id, network=network, allow_internet=allow_internet)

    # -- connect / pause / resume ---------------------------------------------------------

    async def connect(self, sandbox_id: str, timeout: int | None,
                      timings: dict[str, float] | None = None) -> tuple[SandboxRecord, bool]:
        """Running: extend the TTL if longer, return (rec, False). Paused: resume, return
        (rec, True); ``timings`` then receives the resume's phases (seconds)."""
        async with self._lock(sandbox_id):
            rec, claimed = await self._get_or_adopt(sandbox_id)
            if rec.state == SandboxState.PAUSED:
                await self._resume_locked(rec, timeout, timings, claimed)
                return self.get(sandbox_id), True
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {rec.state}")
        if timeout is not None:
            self.extend_timeout(sandbox_id, timeout)
        return self.get(sandbox_id), False

    async def pause(self, sandbox_id: str, memory: bool = True,
                    timings: dict[str, float] | None = None) -> None:
        """Pause a running sandbox. ``timings`` receives where the time went, in the order
        it ran: ``sandbox_lock``, ``store_begin`` (its record to ``pausing``), the
        machines' phases (``NodeMachines.pause``, or ``machines`` when they do not say),
        ``stopped_hooks``, ``store_end`` (its record to ``paused``), ``offer`` (to the
        cluster) and ``collect`` (garbage collection of snapshots)."""
        timer = PhaseTimer()
        async with self._lock(sandbox_id):
            timer.mark("sandbox_lock")
            rec = self.get(sandbox_id)
            if rec.state == SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is already paused")
            if rec.state != SandboxState.RUNNING:
                raise Conflict(f"sandbox '{sandbox_id}' is {rec.state}")
            await self._pause_locked(rec, memory, timer)
        if timings is not None:
            timings.update(timer.phases)

    async def resume(self, sandbox_id: str, timeout: int | None,
                     timings: dict[str, float] | None = None) -> SandboxRecord:
        async with self._lock(sandbox_id):
            rec, claimed = await self._get_or_adopt(sandbox_id)
            if rec.state != SandboxState.PAUSED:
                raise Conflict(f"sandbox '{sandbox_id}' is already running")
            await self._resume_locked(rec, timeout, timings, claimed)
        return self.get(sandbox_id)

    async def _pause_locked(self, rec: SandboxRecord, memory: bool,
                            phases: PhaseTimer | None = None) -> None:
        """``phases``, when given, gets the phases ``pause`` names."""
        if not self.machines.can_pause:
            raise Unsupported("this node cannot pause sandboxes")
        if memory:  # a filesystem pause links the disk: it writes next to nothing
            self.admission.check_pause(rec.memory_mb)
        # The snapshot's name is recorded before it is written, so a restart can tell a
        # finished pause (complete snapshot) from an interrupted one.
        ref = new_snapshot_ref()
        if not self.sandboxes.transition(rec.id, [SandboxState.RUNNING], SandboxState.PAUSING,
                                         snapshot_id=ref):
            raise Conflict(f"sandbox '{rec.id}' changed state")
        phases = phases if phases is not None else PhaseTimer()
        phases.mark("store_begin")
        timer = PhaseTimer(self.clock)
        node: dict[str, float] | None = None
        try:
            node = await self.machines.pause(rec, memory, ref)
        except Exception as e:
            if not self.machines.has_snapshot(ref):
                self._pause_failed(rec, e)
                raise
            # The snapshot was committed and only the VM's end failed: it is paused.
            log.warning("sandbox %s: pause completed despite: %s", rec.id, e)
            await self.machines.stop(rec)
        timer.mark("total")
        record_phases("pause", timer.phases)
        if node:  # the machines account for all of their time
            phases.skip()
            phases.add(node)
        else:  # they do not say
            phases.mark("machines")
        await self._stopped(rec.id)
        phases.mark("stopped_hooks")
        self.sandboxes.transition(
            rec.id, [SandboxState.PAUSING], SandboxState.PAUSED, restored_from=None,
            pause_mode="full" if memory else "filesystem", vm_pid=None, slot=None, host_ip=None,
        )
        phases.mark("store_end")
        await self._offer(rec.id)
        phases.mark("offer")
        await self.collect_garbage()
        phases.mark("collect")

    def _pause_failed(self, rec: SandboxRecord, error: Exception) -> None:
        """No snapshot was committed: the sandbox runs on when its VM is still alive (the
        drivers give it back thawed), else it is lost — never ``running`` without a VM."""
        if self.machines.is_running(rec):
            self.sandboxes.transition(rec.id, [SandboxState.PAUSING], SandboxState.RUNNING,
                                      snapshot_id=None)
            log.warning("sandbox %s: pause failed, still running: %s", rec.id, error)
        else:
            self._end(rec.id, SandboxState.LOST, f"pause failed and the VM is gone: {error}")
            log.error("sandbox %s: pause failed and the VM is gone: %s", rec.id, error)

    async def _resume_locked(self, rec: SandboxRecord, timeout: int | None,
                             timings: dict[str, float] | None = None,
                             claimed: Offer | None = None) -> None:
        handover = self.handover
        try:
            self.admission.check_start(Ask(rec.cpu_count, rec.memory_mb,
                                           cold=rec.pause_mode == "filesystem"))
        except Exception:
            if claimed is not None and handover is not None:
                await asyncio.to_thread(handover.put_back, claimed)
            raise
        if claimed is None and handover is not None and handover.published(rec):
            # Offered to the cluster when paused: whoever claims it first resumes it.
            claimed = await asyncio.to_thread(handover.claim, rec.id)
            if claimed is None or claimed.record.snapshot_id != rec.snapshot_id:
                if claimed is not None:
                    await asyncio.to_thread(handover.put_back, claimed)
                self._moved_away(rec)
                raise SandboxNotFound(rec.id)
        if not self.sandboxes.transition(rec.id, [SandboxState.PAUSED], SandboxState.RESUMING):
            if claimed is not None and handover is not None:
                await asyncio.to_thread(handover.put_back, claimed)
            raise Conflict(f"sandbox '{rec.id}' changed state")
        source = resume_source(rec, self.templates.get(rec.template_id))
        timer = PhaseTimer(self.clock)
        try:
            placement = await self.machines.start(rec, source)
        except Exception:
            self.sandboxes.transition(rec.id, [SandboxState.RESUMING], SandboxState.PAUSED)
            if claimed is not None and handover is not None:
                await asyncio.to_thread(handover.put_back, claimed)
            raise
        now = timer.mark("total")
        record_phases("resume", {**timer.phases, **placement.phases})
        if timings is not None:
            timings.update(placement.phases)
        self.sandboxes.transition(
            rec.id, [SandboxState.RESUMING], SandboxState.RUNNING, **_placed(placement),
            snapshot_id=None,
            end_at=now + (timeout if timeout is not None else DEFAULT_TIMEOUT_S),
        )
        # What the pause kept for its VM (the snapshot it was restored from: a deferred
        # pause's VM lived on while its memory was written) or abandoned (a resume in
        # place, ``NodeMachines._resume_in_place``) is named by nothing now.
        self._collect_soon()

    # -- a cluster's shared store: paused sandboxes other nodes may resume ----------------

    @property
    def handover(self) -> Handover | None:
        """The node's handover (``aenv.cluster.handover``) when it has a shared store."""
        h = getattr(self.machines, "handover", None)
        return h if isinstance(h, Handover) else None

    async def _offer(self, sandbox_id: str) -> None:
        """Offer the just-paused sandbox to the cluster, when its snapshot was published
        and it mounts no volume of this node only (shared volumes: any node serves them)."""
        handover = self.handover
        rec = self.sandboxes.get(sandbox_id)
        if handover is None or rec is None or not handover.published(rec):
            return
        shared = self.shared_volumes
        if rec.volume_mounts and (shared is None or any(
                shared.get(m["volumeID"]) is None for m in rec.volume_mounts)):
            return
        try:
            bundle = await asyncio.to_thread(
                handover.store.bundle, ImageRef.parse(rec.snapshot_id or "").id)
            await asyncio.to_thread(handover.offer, rec, bundle.requires)
        except Exception:
            log.exception("sandbox %s: paused, but not offered to the cluster", sandbox_id)

    async def _get_or_adopt(self, sandbox_id: str) -> tuple[SandboxRecord, Offer | None]:
        """The sandbox's record; when this node has none, a paused sandbox another node
        offered through the shared store, claimed and inserted here (paused) with its
        claim, which the resume puts back if it fails. ``NotRestorable`` when this node
        cannot restore its snapshot (nothing is claimed then)."""
        rec = self.sandboxes.get(sandbox_id)
        handover = self.handover
        if rec is not None or handover is None:
            return self.get(sandbox_id), None
        offer = await asyncio.to_thread(handover.peek, sandbox_id)
        if offer is None:
            raise SandboxNotFound(sandbox_id)
        restorable = getattr(self.machines, "restorable", None)
        why: list[str] = restorable(offer.requires) if restorable is not None else []
        if why:
            raise NotRestorable(f"sandbox '{sandbox_id}' was paused on node {offer.node_id} "
                                f"and cannot be resumed on this node: {'; '.join(why)}")
        self._check_capacity(1)
        claimed = await asyncio.to_thread(handover.claim, sandbox_id)
        if claimed is None:
            raise SandboxNotFound(sandbox_id)
        self.sandboxes.forget_ended(sandbox_id)
        self.sandboxes.insert(claimed.record)
        log.info("sandbox %s: taken over from node %s (paused there)", sandbox_id,
                 claimed.node_id)
        return self.get(sandbox_id), claimed

    @property
    def shared_templates(self) -> SharedTemplates | None:
        s = getattr(self.machines, "shared_templates", None)
        return s if isinstance(s, SharedTemplates) else None

    def _share_template(self, tpl: TemplateRecord) -> None:
        """Put a template or persistent snapshot whose image was published to the shared
        store there too, so that any node can start sandboxes from it."""
        shelf, handover = self.shared_templates, self.handover
        if shelf is None or handover is None or not tpl.image:
            return
        try:
            image = ImageRef.parse(tpl.image)
            if image.is_snapshot and handover.store.has(image.id):
                if self.shared_volumes is not None and (mounts := self._snapshot_mounts(tpl)):
                    self.shared_volumes.put_snapshot_mounts(tpl.id, mounts)
                shelf.put(tpl)
        except Exception:
            log.exception("template %s: not shared with the cluster", tpl.id)

    def _import_template(self, id_or_name: str) -> TemplateRecord | None:
        """A template or persistent snapshot another node shared (``_share_template``),
        recorded here; None when there is none."""
        shelf = self.shared_templates
        if shelf is None:
            return None
        rec = shelf.get(id_or_name)
        if rec is None or rec.status != BuildStatus.READY or not rec.image:
            return None
        if self.templates.get(rec.id) is None:
            try:
                self.templates.insert(rec)
            except NameTaken:  # a name used here by another template: by id only
                self.templates.insert(dataclasses.replace(rec, names=[]))
            log.info("template %s: taken from the shared store", rec.id)
        return self.templates.get(id_or_name) or self.templates.get(rec.id)

    def drop_moved(self) -> int:
        """End the paused sandboxes that another node claimed (resumed there while this
        node was gone or full): they live there now."""
        handover = self.handover
        if handover is None:
            return 0
        moved = 0
        for rec in self.sandboxes.in_states([SandboxState.PAUSED]):
            if not self._lock(rec.id).locked() and handover.moved(rec):
                self._moved_away(rec)
                moved += 1
        return moved

    def _moved_away(self, rec: SandboxRecord) -> None:
        """End the paused ``rec``: another node resumed it (its snapshot stays until
        collection finds it unused)."""
        if self.sandboxes.transition(rec.id, [SandboxState.PAUSED], SandboxState.KILLING):
            self._end(rec.id, SandboxState.KILLED, "resumed on another node")
            log.info("sandbox %s: resumed on another node; forgotten here", rec.id)

    # -- TTL ------------------------------------------------------------------------------

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_interval)
            try:
                await self.expire_once()
            except Exception:
                log.exception("TTL sweep failed")

    async def expire_once(self) -> None:
        now = self.clock()
        self.drop_moved()
        if now - self._purged_at > PURGE_INTERVAL_S:
            self._purged_at = now
            purged = self.sandboxes.purge_ended(now - self.limits.retention_s)
            if purged:
                log.info("forgot %d sandboxes that ended over %.0f h ago", purged,
                         self.limits.retention_s / 3600)
        for rec in self.sandboxes.expired(self.clock()):
            if self._lock(rec.id).locked():
                continue  # an operation is in flight; look again next tick
            try:
                if rec.auto_pause and self.machines.can_pause:
                    log.info("sandbox %s: TTL reached, pausing", rec.id)
                    async with self._lock(rec.id):
                        cur = self.sandboxes.get(rec.id)
                        if cur and cur.state == SandboxState.RUNNING and cur.end_at <= self.clock():
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
        """Reconcile the store with what survived a restart: adopt running VMs (also those
        caught in a snapshot or fork capture), finish interrupted kills, keep interrupted
        pauses whose snapshot is complete, report the rest lost."""
        for rec in self.sandboxes.live():
            if rec.state == SandboxState.PAUSED:
                continue
            if rec.state == SandboxState.PAUSING and rec.snapshot_id and \
                    self.machines.has_snapshot(rec.snapshot_id):
                await self.machines.stop(rec)
                self.sandboxes.transition(rec.id, [SandboxState.PAUSING], SandboxState.PAUSED,
                                          vm_pid=None, slot=None, host_ip=None,
                                          restored_from=None)
                log.info("sandbox %s: its pause finished before the restart", rec.id)
                continue
            if rec.state == SandboxState.RESUMING and await self._recover_in_place(rec):
                continue
            if rec.state in _REATTACHABLE and await self.machines.reattach(rec):
                self.sandboxes.transition(rec.id, [rec.state], SandboxState.RUNNING,
                                          snapshot_id=None)
                log.info("sandbox %s: re-attached after restart (was %s)", rec.id, rec.state)
                continue
            await self.machines.stop(rec)
            if rec.state == SandboxState.KILLING:
                self._end(rec.id, SandboxState.KILLED, "killed")
            elif rec.state == SandboxState.RESUMING and rec.snapshot_id:
                # The snapshot it was resuming from is intact: back to paused.
                self.sandboxes.transition(rec.id, [SandboxState.RESUMING], SandboxState.PAUSED,
                                          vm_pid=None, slot=None, host_ip=None)
            else:
                self._end(rec.id, SandboxState.LOST,
                          f"VM gone after server restart (was {rec.state})")
                log.warning("sandbox %s: lost after restart (was %s)", rec.id, rec.state)
        recovered = getattr(self.machines, "recovered", None)
        if recovered is not None:  # slots kept for a resume in place that none finished
            await recovered()
        await self.collect_garbage()

    async def _recover_in_place(self, rec: SandboxRecord) -> bool:
        """A resume that continued its paused VM in place (``NodeMachines``'s, while the
        pause's memory was still being written) and was cut by the restart: finished, the
        sandbox running in the VM it never left; or lost when that VM did not survive (the
        pause's snapshot was abandoned). False when the resume was not one of those."""
        finish = getattr(self.machines, "recover_in_place", None)
        if finish is None:
            return False
        try:
            placement = await finish(rec, resume_source(rec, self.templates.get(rec.template_id)))
        except NotRestorable as e:
            await self.machines.stop(rec)
            self._end(rec.id, SandboxState.LOST, str(e))
            log.warning("sandbox %s: lost after restart: %s", rec.id, e)
            return True
        if placement is None:
            return False
        self.sandboxes.transition(
            rec.id, [SandboxState.RESUMING], SandboxState.RUNNING, **_placed(placement),
            snapshot_id=None, end_at=self.clock() + DEFAULT_TIMEOUT_S)
        log.info("sandbox %s: its resume in place finished after the restart", rec.id)
        return True

    def _end(self, sandbox_id: str, state: SandboxState, reason: str) -> None:
        """End the sandbox (``killed`` or ``lost``) from whatever state it is in."""
        rec = self.sandboxes.get(sandbox_id, live_only=False)
        if rec is not None:
            self.sandboxes.transition(sandbox_id, [rec.state], state, reason=reason,
                                      ended_at=self.clock(), vm_pid=None)


def whole_microseconds(t: float) -> float:
    """``t`` at the precision the API shows (RFC 3339 with microseconds): a start time
    read back from the API and sent as ``startedAfter`` then compares equal to the stored
    one, instead of rounding past it."""
    return round(t * 1_000_000) / 1_000_000


def _spread(per_child: list[dict[str, float]]) -> dict[str, float]:
    """``{phase}_p50`` and ``{phase}_max`` of each phase over the children's phase dicts."""
    out: dict[str, float] = {}
    for phase in dict.fromkeys(k for d in per_child for k in d):
        values = [d[phase] for d in per_child if phase in d]
        out[f"{phase}_p50"] = statistics.median_low(values)
        out[f"{phase}_max"] = max(values)
    return out


def _placed(p: Placement) -> dict[str, Any]:
    """The record fields a placement sets."""
    return dict(vm_dir=p.vm_dir, vm_pid=p.vm_pid, slot=p.slot, host_ip=p.host_ip,
                runtime=p.runtime, restored_from=p.restored_from)
