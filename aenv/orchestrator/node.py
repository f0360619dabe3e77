"""``NodeMachines``: sandboxes as microVMs on this host.

For each sandbox: a network slot from the pool, a copy-on-write disk over its template's
image (the node's base image, a built image or a committed layer; for an image without a
guest layer of its own, the shared read-only tools drive as a second drive, and the boot
arguments that make the initramfs mount it), a VM working directory under
``vms_dir/<sandbox id>``, the VMM booted through the configured runtime driver, and envd
waited for and initialised (token, env vars, default user and workdir). Everything made is
released again on failure, on kill, and for VMs found dead after a restart.

A memory pause of a restored VM answers before its memory is written
(``Settings.pause_memory_in_background``, not with a shared store): ``VM.pause_deferred``
commits the snapshot with a ``memory.pending`` marker, and ``_finish_pause`` writes the
memory from the frozen VMM in the background, then ends it and releases its slot. A resume
that arrives meanwhile (``Settings.resume_in_place``) continues that VMM in place
(``_resume_in_place``): the write is abandoned (``DeferredMemory.abandon``: the marker
becomes ``memory.abandoned``, the drives are the VM's again), QMP ``cont``, envd's
``/init``; same slot, address and working directory; the abandoned snapshot is collected
once the record no longer names it. A resume that finds the write already committing
waits for it, then restores as usual. A kill meanwhile (or any end of the record) leaves
the VMM to collection, which abandons a write whose snapshot nothing names any more
(``_drop_unnamed_writes``: the VMM ends, its slot and directory are released; a pause
snapshot is only ever named by its own sandbox's record and by pins of operations on it)
and keeps the snapshot of a write it cannot abandon until the write has finished. After
a restart ``prepare`` keeps a pausing VMM and its slot and writes the memory from it
(``_adopt_pending``); when the VMM did not survive, the marker stays and a resume is
refused with that reason (``_memory_written``), never made from a half-written layer. An
abandoned marker's VMM and slot are kept too, and a ``resuming`` record is finished in
place (``recover_in_place``) or lost with its VMM; a slot kept so that no recovery took is
freed once the recovery is over (``recovered``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..client.envd import EnvdClient
from ..cluster.handover import Handover, SharedTemplates
from ..cluster.node_setup import node_id, restores
from ..config import Settings
from ..egress.socks import SocksProxy
from ..envd import ENVD_PORT
from ..guest.bootargs import ToolsBoot, guest_boot_args
from ..network import EgressPolicy, NetworkSlot, SlotPool, cleanup_leftovers
from ..network.guest_link import TAP_IP
from ..network.policy import header_rules
from ..runtime import (
    VM,
    AttachError,
    Confinement,
    DeferredMemory,
    Drive,
    MemoryWriteAbandoned,
    RestoreOverrides,
    VMError,
    VMSpec,
    confine,
    console,
    get_runtime,
)
from ..runtime import workdir as wd
from ..runtime.compaction import Compactor
from ..runtime.ready import boot_until_ready
from ..runtime.vmm_pool import Pooled, VMMPool
from ..storage import disk_layers, disks, shared_store, snapshot_store, volume_server
from ..storage import snapshots as snapshot_files
from ..storage.disks import Disk, create_disk
from ..storage.errors import ImageError, StorageError
from ..storage.image_ref import ImageRef
from ..storage.images import Image, ensure_base_image, image_by_digest
from ..storage.kernel import Kernel, ensure_kernel
from ..storage.tools_drive import ToolsDrive, disk_uses_tools, ensure_tools_drive
from ..store import SandboxRecord, TemplateRecord
from .errors import InvalidRequest, NotRestorable
from .machine import NodeResources, Placement
from .timing import PhaseTimer

log = logging.getLogger("aenv.node")

ENVD_READY_TIMEOUT_S = 60.0
TEMPLATE_CLIENT = "aenv-template"  # client_id of a template's snapshot boot (service.py)
BUILD_CLIENT = "aenv-build"  # client_id of a template build's VM (builds.py)
START_READY_TIMEOUT_S = 120.0
GUEST_SYNC_TIMEOUT_S = 60.0  # a filesystem pause's `sync` in the guest
# How long a VMM pre-started for a paused sandbox's resume waits (``VMMPool.want_once``).
RESUME_PRESTART_S = 60.0
# Pauses' memory writes at once (``_finish_pause``): each is a thread bound by the disk for
# a second or so; a burst of pauses (TTL auto-pause) queues instead of taking every
# blocking thread and competing for the disk.
PAUSE_WRITES = 2
CONSOLE_CHECK_S = 10.0  # how often the running VMs' console logs are held to their bound


@dataclass
class _Running:
    vm: VM
    slot: NetworkSlot
    disk: Disk | None


def _free_mb(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize >> 20


def _host_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) >> 10
    raise OSError("no MemTotal in /proc/meminfo")


def _bound_all(logs: list[Path]) -> int:
    return sum(console.bound(path) for path in logs)


def _restore_phases(t: dict[str, float], total: float) -> dict[str, float]:
    """A restore of ``total`` seconds as consecutive phases, from its ``boot_timings``
    (seconds after spawn, and ``prepare`` before it) when the driver reports them, else
    as one ``restore``."""
    if not {"prepare", "qmp_ready", "memory_applied", "running"} <= t.keys():
        return {"restore": total}
    return {"prepare": t["prepare"], "vmm": t["qmp_ready"],
            "memory": t["memory_applied"] - t["qmp_ready"],
            "state_load": total - t["prepare"] - t["memory_applied"]}


async def _cancelled(task: asyncio.Task[None] | None) -> None:
    """End ``task`` (an /init sent ahead) if it still runs; its outcome no longer matters."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


def egress_policy(rec: SandboxRecord) -> EgressPolicy:
    net = rec.network or {}
    try:
        return EgressPolicy.build(
            allow_out=net.get("allowOut") or (), deny_out=net.get("denyOut") or (),
            allow_internet=rec.allow_internet is not False,
            rules=header_rules(net.get("rules")), dns_servers=net.get("dnsServers"),
            upstream=SocksProxy.from_option(net["egressProxy"])
            if net.get("egressProxy") else None)
    except ValueError as e:
        raise InvalidRequest(f"invalid network policy: {e}") from e


class NodeMachines:
    can_pause = True

    def __init__(self, settings: Settings, *, kernel_flavor: str = "cloud") -> None:
        self.settings = settings
        self.kernel_flavor = kernel_flavor
        # VMMs confined under this server's name prefix (own uid, seccomp, chroot, cgroup).
        self.runtime = get_runtime(
            settings.runtime, confinement=Confinement.from_settings(settings),
            track_writes=settings.native_dir if settings.track_writes else None)
        # Only the server's own (marked) connections reach a sandbox's host address: the
        # proxy, envd and metrics clients mark theirs (client.http, network.access). Taps
        # belong to the VMMs' group, which a jailed Firecracker opens them as.
        self.pool = SlotPool(settings, server_only=True, tap_gid=confine.VMM_GID)
        self.kernel: Kernel | None = None
        self.base: Image | None = None
        self._tools: ToolsDrive | None = None  # built on the first boot that needs it
        self._running: dict[str, _Running] = {}
        # The egress proxy's CA (set by the server): every guest trusts it (/init).
        self.egress_ca: str | None = None
        self._starts = 0  # VM starts under way: the VMM pool refills between them
        # VMMs started ahead of demand in warm slots, waiting for a create to load a
        # template's state (``aenv.runtime.vmm_pool``), when the driver can.
        self.vmm_pool: VMMPool[NetworkSlot] | None = None
        if hasattr(self.runtime, "prestart") and settings.vmm_pool_size > 0:
            self.vmm_pool = VMMPool(
                self.runtime, settings.vms_dir,  # type: ignore[arg-type]
                size=settings.vmm_pool_size, memory_mb=settings.vmm_pool_memory_mb,
                acquire=lambda: asyncio.to_thread(self.pool.acquire),
                release=lambda slot: asyncio.to_thread(self._release, slot),
                busy=lambda: self._starts > 0)
        # Snapshot writes and garbage collection never overlap (a half-written snapshot
        # is not yet anyone's root).
        self._snapshot_lock = asyncio.Lock()
        # Chains that grew too deep are compacted after the capture returned, not on its
        # request's path (``aenv.runtime.compaction``).
        self.compactor = Compactor(self.runtime, self._snapshot_lock)
        # Pauses that answered before their memory was written (``_finish_pause``), by
        # snapshot name: a resume waits for its own, collection keeps theirs.
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._pending_workdirs: dict[str, Path] = {}  # the VMM's of each, by the same name
        # What a resume in place takes over from each (``_resume_in_place``): the write
        # (to abandon), and the slot its VMM still holds.
        self._deferred: dict[str, tuple[DeferredMemory, NetworkSlot | None]] = {}
        # Slot indices ``prepare`` kept only for a resume in place to be finished
        # (``recover_in_place``); what no recovery adopted is freed by ``recovered``.
        self._in_place_slots: set[int] = set()
        self._pause_writes = asyncio.Semaphore(PAUSE_WRITES)
        self._console_task: asyncio.Task[None] | None = None
        # In a cluster with a shared store: pauses and snapshots are published there, and
        # a snapshot this node lacks is fetched from there (``aenv.storage.shared_store``);
        # ``handover`` offers paused sandboxes to the other nodes (``aenv.cluster``).
        self.shared: shared_store.SharedStore | None = None
        self.handover: Handover | None = None
        self.shared_templates: SharedTemplates | None = None
        if settings.shared_store is not None:
            self.shared = shared_store.SharedStore(settings.shared_store)
            self.handover = Handover(self.shared, node_id(settings))
            self.shared_templates = SharedTemplates(self.shared)

    # -- node life ------------------------------------------------------------------------

    async def prepare(self, keep_slots: set[int], keep_vms: set[str]) -> None:
        """Make sure the kernel and base image exist, clear a crashed run's leftovers
        (except ``keep_slots``, still used by sandboxes to re-attach), start the pool."""
        self.kernel = await asyncio.to_thread(ensure_kernel, self.settings, self.kernel_flavor)
        self.base = await asyncio.to_thread(ensure_base_image, self.settings, None,
                                            kernel_flavor=self.kernel_flavor)
        # Pauses whose memory a stopped server had not written yet: their frozen VMMs and
        # slots are kept, and the memory written now (``_adopt_pending``).
        pending = await asyncio.to_thread(self._pending_pauses)
        keep_vms = keep_vms | {p.vm_dir.name for _, p in pending}
        keep_slots = keep_slots | {int(p.note["slot"]) for _, p in pending
                                   if isinstance(p.note.get("slot"), int)}
        # Resumes in place a stopped server had begun: while a live record names the
        # VMM's directory (and it exists), its slot is kept for ``recover_in_place`` (or
        # for ``reattach``, once the record says running). One kept for nothing else and
        # not adopted by the end of the recovery is freed then (``recovered``).
        in_place = {
            int(p.note["slot"]) for _, p in await asyncio.to_thread(self._abandoned_pauses)
            if isinstance(p.note.get("slot"), int) and p.vm_dir.name in keep_vms
            and p.vm_dir.is_dir()}
        self._in_place_slots = in_place - keep_slots
        keep_slots = keep_slots | in_place
        # A crashed server's pooled VMMs still wait in their slots: end them first.
        killed = await asyncio.to_thread(VMMPool.sweep, self.settings.vms_dir, keep_vms)
        if killed:
            log.info("ended %d pre-started VMMs of a previous run", len(killed))
        report = await asyncio.to_thread(cleanup_leftovers, self.settings, keep_slots)
        if report:
            log.info("removed leftovers of a previous run: %s", report.summary())
        await asyncio.to_thread(volume_server.sweep, self.settings)  # slots gone: theirs too
        for d in self.settings.vms_dir.glob("*") if self.settings.vms_dir.is_dir() else ():
            if d.name not in keep_vms:
                wd.remove(d)
        swept = await asyncio.to_thread(self.runtime.cleanup_leftovers, self.settings.vms_dir,
                                        keep_vms)
        if any(swept.values()):
            log.info("removed VMM leftovers of a previous run: %s", swept)
        await asyncio.to_thread(self.pool.start, keep_slots)
        for directory, p in pending:
            await self._adopt_pending(directory, p)
        if self.vmm_pool is not None:
            self.vmm_pool.start()
        # What a stopped server left half-compacted (or never compacted) is finished.
        self.compactor.recover(self.settings.snapshots_dir)
        self._console_task = asyncio.create_task(self._bound_consoles(), name="aenv-consoles")

    def resources(self) -> NodeResources:
        home = self.settings.home
        home.mkdir(parents=True, exist_ok=True)
        shm = wd.ram_file_dir()
        return NodeResources(
            cpus=os.cpu_count() or 1, memory_mb=_host_memory_mb(),
            disk_free_mb=_free_mb(home),
            ram_file_free_mb=_free_mb(shm) if shm is not None else None)

    def image_key(self) -> str | None:
        return f"base-{self.base.digest[:16]}" if self.base else None

    async def close(self) -> None:
        """Stop watching; running VMs keep running (a restart re-attaches them). Pauses
        still writing memory finish first (seconds: the copy of what the guest wrote)."""
        if self._console_task is not None:
            self._console_task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending.values(), return_exceptions=True)
        await self.compactor.close()
        for r in self._running.values():
            await r.vm.detach()
        if self.vmm_pool is not None:  # pooled VMMs are no sandbox's: they end here
            await self.vmm_pool.close()
        await asyncio.to_thread(self.pool.close, True)

    async def _bound_consoles(self) -> None:
        """Keep every running guest's serial log to its bound (``runtime.console``)."""
        while True:
            await asyncio.sleep(CONSOLE_CHECK_S)
            logs = [r.vm.console_log for r in self._running.values()]
            try:
                cut = await asyncio.to_thread(_bound_all, logs)
            except OSError:
                log.exception("bounding the console logs failed")
                continue
            if cut:
                log.info("console logs: cut %d bytes of old output", cut)

    def in_use(self) -> set[int]:
        return {r.slot.index for r in self._running.values()}

    # -- one sandbox ----------------------------------------------------------------------

    def _image_for(self, image: ImageRef) -> Path:
        """The disk image a cold boot from ``image`` starts from."""
        if image.is_layer:
            return disk_layers.resolve(image, self.settings.layers_dir).path
        if image.is_snapshot:
            disk = snapshot_store.disk_snapshot(self._snapshot_dir(image))
            if disk is None:
                raise InvalidRequest(f"{image} is a VM snapshot, not a disk")
            return disk.drive
        if image.is_image:
            try:
                return image_by_digest(self.settings, image.id).path
            except ImageError as e:
                raise InvalidRequest(str(e)) from e
        assert self.base is not None, "prepare() first"
        return self.base.path

    def _tools_boot(self, image: ImageRef, path: Path) -> ToolsBoot:
        """Whether a cold boot of ``path`` (``image``'s disk) gets the tools drive: the base
        image never, a built image when its manifest says so, a layer or disk snapshot as
        the image its chain ends at says, or ("fallback") attached for the guest to use when
        the chain does not tell (a raw disk snapshot)."""
        assert self.kernel is not None, "prepare() first"
        if image.is_base:
            return False
        uses = disk_uses_tools(self.settings, path)
        if self.kernel.initrd is None:  # the small kernel: no initramfs to mount it
            if uses:
                raise InvalidRequest(f"{image} boots with the tools drive, which needs the "
                                     "cloud kernel's initramfs")
            return False
        return "fallback" if uses is None else uses

    async def _tools_drive(self) -> ToolsDrive:
        if self._tools is None or not self._tools.path.is_file():
            self._tools = await asyncio.to_thread(ensure_tools_drive, self.settings)
        return self._tools

    def _snapshot_dir(self, ref: str | ImageRef) -> Path:
        return snapshot_store.directory(self.settings.snapshots_dir, ref)

    def has_snapshot(self, ref: str) -> bool:
        try:
            return snapshot_store.is_complete(self._snapshot_dir(ref))
        except snapshot_store.SnapshotMissing:
            return False

    async def start(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
        """Boot or restore ``rec``'s VM, mount its volumes, and then, on a cold boot of a
        template that has one, run the template's start command: after the mounts, so that
        it finds them. (A template restored from its snapshot has run its start command
        since its build, as in E2B: that process finds a volume once it is mounted, which
        is before the create answers.)"""
        placement = await self._start_vm(rec, template)
        if rec.volume_mounts:
            await self._mount_volumes(rec, template, placement)
        elif rec.client_id == TEMPLATE_CLIENT:
            await self._init_volumes(rec, template, placement, [], modules=True)
        running = self._running.get(rec.id)
        if template.start_cmd and running is not None and running.disk is not None:
            envd = EnvdClient(f"http://{placement.host_ip}:{ENVD_PORT}", rec.envd_token)
            try:
                await self._start_command(envd, template)
            except BaseException:
                await self.stop(rec)
                raise
            finally:
                await envd.aclose()
        return placement

    async def _mount_volumes(self, rec: SandboxRecord, template: TemplateRecord,
                             placement: Placement) -> None:
        """Serve ``rec``'s volumes in its slot's namespace and have envd mount them (a
        restored guest has them mounted already: its NFS client reconnects to this
        server). Any failure ends the sandbox's VM (``aenv.storage.volume_server``)."""
        t0 = time.perf_counter()
        mounts = rec.volume_mounts or []
        try:
            running = self._running[rec.id]
            await asyncio.to_thread(volume_server.start, self.settings, running.slot.netns,
                                    sorted({m["volumeID"] for m in mounts}))
            await self._init_volumes(rec, template, placement, mounts, modules=False)
        except BaseException:
            await self.stop(rec)
            raise
        placement.phases["volumes"] = time.perf_counter() - t0

    async def _init_volumes(self, rec: SandboxRecord, template: TemplateRecord,
                            placement: Placement, mounts: list[dict[str, str]], *,
                            modules: bool) -> None:
        """envd's ``/init`` with ``volumeMounts``; with ``modules`` (a template's snapshot
        boot) only the NFS client is loaded, so that every sandbox restored from the
        snapshot has it: a failure there is logged, the template is made anyway."""
        envd = EnvdClient(f"http://{placement.host_ip}:{ENVD_PORT}")
        try:
            await envd.init(
                access_token=rec.envd_token, env_vars=rec.env_vars,
                default_user=template.user or "user", default_workdir=template.workdir,
                current_token=rec.envd_token, timeout=60.0, volume_modules=modules,
                volume_mounts=[{"name": m["name"], "path": m["path"], "nfsTarget":
                                f"{TAP_IP}:{volume_server.export_path(m['volumeID'])}"}
                               for m in mounts])
        except Exception as e:
            if not modules:
                raise
            log.warning("template %s: NFS modules not preloaded: %s", rec.template_id, e)
        finally:
            await envd.aclose()

    async def _start_vm(self, rec: SandboxRecord, template: TemplateRecord) -> Placement:
        image = ImageRef.parse(template.image)
        # The pools' fillers keep their CPU off the host while guests come up.
        self._starts += 1
        try:
            # A fork's children start together: the pool refills once they all ran.
            with self.pool.starting(burst=template.build_id == "fork"):
                if image.is_snapshot:
                    directory = self._snapshot_dir(image)
                    if template.build_id == "resume" and self.settings.resume_in_place:
                        placement = await self._resume_in_place(rec, template, directory)
                        if placement is not None:
                            return placement
                    await self._memory_written(directory)
                    if not snapshot_store.is_complete(directory):
                        await self.fetch(image.id)
                    if not snapshot_store.is_complete(directory):
                        raise InvalidRequest(f"snapshot {image} does not exist on this node")
                    if snapshot_store.disk_snapshot(directory) is None:
                        return await self._restore(rec, template, directory)
                return await self._boot(rec, template, image)
        finally:
            self._starts -= 1

    async def _restore(self, rec: SandboxRecord, template: TemplateRecord,
                       directory: Path, *, pooled: bool = True) -> Placement:
        """Restore a VM snapshot into a free slot; processes and memory carry on. A VMM
        pre-started for ``directory`` (``vmm_pool``) only gets its state loaded.
        Phases: ``slot``, then ``prepare`` (working directory, disks, confinement), ``vmm``
        (spawn to QMP), ``memory`` (diff layers) and ``state_load`` (device state, vCPUs
        on) — or ``pool`` (taking a pre-started VMM, its slot's egress policy) and
        ``state_load`` — then ``envd_init`` (the guest runs until envd answered)."""
        timer = PhaseTimer()
        # A fork's capture is new (no VMM can be waiting for it); a paused sandbox's may
        # have one pre-started after its pause (``want_once``). template_records' names.
        kind = template.build_id if template.build_id in ("fork", "resume") else "template"
        taken = None
        if pooled and kind != "fork":
            taken = await self._take_pooled(rec, directory, once=kind == "resume")
        if taken is not None:
            timer.mark("pool")
            return await self._activate(rec, template, directory, taken, timer)
        slot = await asyncio.to_thread(self.pool.acquire, egress_policy(rec))
        timer.mark("slot")
        workdir = self.settings.vms_dir / rec.id
        vm: VM | None = None
        init: asyncio.Task[None] | None = None
        overrides = RestoreOverrides(vm_id=rec.id, workdir=workdir, netns=slot.netns)
        try:
            if getattr(self.runtime, "nic_open_at_prestart", False):
                # /init pipelined: sent once the VMM holds the tap, while its state loads
                # (what reaches the tap before the vCPUs run waits there for the guest).
                pre = await self.runtime.prestart(  # type: ignore[attr-defined]
                    directory, overrides)
                init = asyncio.create_task(self._init_envd(
                    f"http://{slot.host_ip}:{ENVD_PORT}", rec, template, restored=True,
                    alive=pre.is_alive))
                vm = await self.runtime.activate(pre)  # type: ignore[attr-defined]
            else:
                vm = await self.runtime.restore(directory, overrides)
        except BaseException:
            await _cancelled(init)
            await self._abandon(vm, workdir, slot)
            raise
        assert vm is not None
        restored_at = timer.elapsed()
        timer.skip()
        timer.add(_restore_phases(vm.boot_timings, restored_at - timer.phases["slot"]))
        return await self._restored(rec, template, vm, slot, workdir, timer,
                                    f"restored from {directory.name} into slot {slot.index}",
                                    init=init)

    async def _restored(self, rec: SandboxRecord, template: TemplateRecord, vm: VM,
                        slot: NetworkSlot, workdir: Path, timer: PhaseTimer,
                        how: str, *, init: asyncio.Task[None] | None = None) -> Placement:
        """The end of every restore, pooled or not: envd's ``/init`` (or ``init``, the one
        already sent), then the sandbox runs. No /health first: the guest's envd was
        running when it was captured, and the first /init that connects is the readiness
        check (one round trip fewer per child of a fork, where every guest competes for
        the host's cores). A failed /init abandons the VM, its directory and its slot."""
        try:
            if init is not None:
                await init
            else:
                await self._init_envd(f"http://{slot.host_ip}:{ENVD_PORT}", rec, template,
                                      restored=True, alive=vm.is_alive)
        except BaseException:
            await _cancelled(init)
            await self._abandon(vm, workdir, slot)
            raise
        self._running[rec.id] = _Running(vm, slot, None)
        timer.mark("envd_init")
        log.info("sandbox %s: %s, %s", rec.id, how, timer.summary(),
                 extra={"sandbox_id": rec.id, "op": "restore", "duration": timer.elapsed()})
        return Placement(vm_dir=str(workdir), vm_pid=vm.pid, slot=slot.index,
                         host_ip=slot.host_ip, runtime=self.runtime.name, phases=timer.phases,
                         restored_from=template.image)

    async def _take_pooled(self, rec: SandboxRecord, directory: Path, *,
                           once: bool = False) -> Pooled[NetworkSlot] | None:
        """A pre-started VMM of ``directory`` with ``rec``'s egress policy on its slot, or
        None (no pool, none waiting, or the policy could not be set). ``once``: a paused
        sandbox's snapshot (``VMMPool.take``)."""
        if self.vmm_pool is None:
            return None
        pooled = await self.vmm_pool.take(directory, once=once)
        if pooled is None:
            return None
        try:
            await asyncio.to_thread(pooled.slot.set_policy, egress_policy(rec))
        except BaseException:
            await self.vmm_pool.discard(pooled)
            raise
        return pooled

    async def _activate(self, rec: SandboxRecord, template: TemplateRecord, directory: Path,
                        pooled: Pooled[NetworkSlot], timer: PhaseTimer) -> Placement:
        """The rest of ``_restore`` for a pre-started VMM: load its state, start it, /init.
        A VMM that fails to load is discarded and the sandbox restored as usual."""
        slot, workdir = pooled.slot, pooled.workdir
        vm: VM | None = None
        assert self.vmm_pool is not None
        try:
            vm = await self.runtime.activate(pooled.pre)  # type: ignore[attr-defined]
        except VMError as e:
            log.warning("sandbox %s: pre-started VMM %s failed (%s); restoring anew", rec.id,
                        pooled.pre.vm_id, e)
            await self.vmm_pool.discard(pooled)
            return await self._restore_anew(rec, template, directory, timer)
        except BaseException:
            await self.vmm_pool.discard(pooled)  # its directory and slot go too
            raise
        assert vm is not None
        timer.mark("state_load")
        return await self._restored(
            rec, template, vm, slot, workdir, timer,
            f"pre-started VMM {vm.vm_id} of {directory.name} in slot {slot.index}")

    async def _restore_anew(self, rec: SandboxRecord, template: TemplateRecord,
                            directory: Path, timer: PhaseTimer) -> Placement:
        """An ordinary restore after a pooled VMM failed; its phases join ``timer``'s."""
        placement = await self._restore(rec, template, directory, pooled=False)
        timer.mark("pool_failed")
        phases = {**timer.phases, **placement.phases}
        phases["pool_failed"] -= sum(placement.phases.values())
        return dataclasses.replace(placement, phases=phases)

    async def _boot(self, rec: SandboxRecord, template: TemplateRecord,
                    image: ImageRef) -> Placement:
        """Cold boot of ``image``'s disk (``template``'s image, parsed)."""
        assert self.kernel is not None, "prepare() first"
        timer = PhaseTimer()
        policy = egress_policy(rec)
        slot = await asyncio.to_thread(self.pool.acquire, policy)
        timer.mark("slot")
        workdir = self.settings.vms_dir / rec.id
        vm: VM | None = None
        disk: Disk | None = None
        try:
            source = self._image_for(image)
            tools = await asyncio.to_thread(self._tools_boot, image, source)
            disk = await asyncio.to_thread(create_disk, source, workdir)
            drives = [Drive("rootfs", disk.path, format=disk.format)]
            if tools:
                # Shared by every VM, never copied: attached read-only by its path, which
                # the VM's snapshots record (the drive is never deleted).
                drives.append(Drive("tools", (await self._tools_drive()).path, read_only=True))
            timer.mark("disk")
            spec = VMSpec(
                vm_id=rec.id, workdir=workdir, kernel=self.kernel.vmlinux,
                initrd=self.kernel.initrd, boot_args=guest_boot_args(self.kernel, tools=tools),
                vcpus=rec.cpu_count, memory_mib=rec.memory_mb,
                drives=tuple(drives),
                tap=slot.tap_name, netns=slot.netns, mac=slot.guest_mac,
                memory_file=wd.default_memory_file(rec.id, workdir, self.settings.name_prefix),
            )
            url = f"http://{slot.host_ip}:{ENVD_PORT}"
            vm, boot = await boot_until_ready(self.runtime, spec, url, ENVD_READY_TIMEOUT_S)
            # The host's share of the boot, then the guest's phases as the console showed.
            timer.mark("prepare", excluding=boot.total)
            timer.add({"vmm": boot.vmm_to_qmp, "kernel": boot.kernel_to_init,
                       "init": boot.init_to_envd_exec, "envd": boot.envd_exec_to_health})
            await self._init_envd(url, rec, template, restored=False)
        except BaseException:
            await self._abandon(vm, workdir, slot)
            raise
        self._running[rec.id] = _Running(vm, slot, disk)
        timer.mark("envd_init")
        log.info("sandbox %s: slot %d, disk %s, %s", rec.id, slot.index, disk.method,
                 timer.summary(),
                 extra={"sandbox_id": rec.id, "op": "create", "duration": timer.elapsed()})
        # A disk made over a snapshot's or layer's file needs that file for its whole life.
        backing = None if image.is_base else template.image
        return Placement(vm_dir=str(workdir), vm_pid=vm.pid, slot=slot.index,
                         host_ip=slot.host_ip, runtime=self.runtime.name, phases=timer.phases,
                         restored_from=backing)

    async def _init_envd(self, url: str, rec: SandboxRecord, template: TemplateRecord, *,
                         restored: bool, alive: Callable[[], bool] | None = None) -> None:
        """Hand the guest its identity. After a restore the clock is as old as the snapshot
        and the RNG state is shared with every other restore of it: /init fixes both, and
        the token inside the snapshot authorises handing over this sandbox's. With
        ``alive`` (a restore: whether its VMM still runs) this also waits for envd to
        accept. (A cold boot's start command runs later, after the volume mounts:
        ``start``.)"""
        envd = EnvdClient(url)
        try:
            await envd.init(access_token=rec.envd_token, env_vars=rec.env_vars,
                            default_user=template.user or "user",
                            default_workdir=template.workdir,
                            current_token=template.envd_token if restored else None,
                            entropy=os.urandom(64), ca_bundle=self.egress_ca,
                            wait=ENVD_READY_TIMEOUT_S if alive else 0.0, alive=alive)
        finally:
            await envd.aclose()

    async def _abandon(self, vm: VM | None, workdir: Path, slot: NetworkSlot) -> None:
        """Undo a start that failed half way."""
        if vm is not None:
            await vm.stop()
        await asyncio.to_thread(wd.remove, workdir)
        await asyncio.to_thread(self._release, slot)

    async def _start_command(self, envd: EnvdClient, template: TemplateRecord) -> None:
        """Cold-boot path for templates with a start command: run it, wait for ready."""
        user = template.user or "user"
        await envd.start_background(template.start_cmd or "", user=user, cwd=template.workdir,
                                    envs=template.env_vars)
        ready = template.ready_cmd or "sleep 1"
        deadline = time.monotonic() + START_READY_TIMEOUT_S
        while (await envd.run(ready, user=user, cwd=template.workdir, envs=template.env_vars,
                              timeout=60)).exit_code != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ready command did not succeed: {ready}")
            await asyncio.sleep(0.5)

    def _release(self, slot: NetworkSlot) -> None:
        try:
            volume_server.stop(self.settings, slot.netns)
            self.pool.release(slot)
        except Exception:
            log.exception("slot %d: release failed", slot.index)

    async def stop(self, rec: SandboxRecord) -> None:
        running = self._running.pop(rec.id, None)
        if running is not None:
            await running.vm.stop()
            await asyncio.to_thread(self._release, running.slot)
        elif rec.vm_dir and self._writing_from(Path(rec.vm_dir)):
            # A pause's memory write owns that VMM, slot and directory (_finish_pause),
            # until collection, which abandons it once nothing names its snapshot.
            return
        elif rec.slot is not None and rec.slot not in self.in_use():
            await self._stop_orphan(rec, rec.slot)
        if rec.vm_dir:
            # Unlinking a guest-RAM file of hundreds of MiB takes tens of ms: not on the loop.
            await asyncio.to_thread(wd.remove, Path(rec.vm_dir))

    async def _stop_orphan(self, rec: SandboxRecord, slot_index: int) -> None:
        """After a restart: end a VM this server never adopted and free the slot that
        ``prepare`` kept for it (``slot_index``: the record's)."""
        if rec.vm_dir:
            try:
                vm = await self.runtime.attach(Path(rec.vm_dir))
                await vm.stop()
            except AttachError:
                pass
        try:
            slot = await asyncio.to_thread(self.pool.adopt, slot_index, egress_policy(rec))
        except Exception:
            return  # gone already; adopt freed the index
        await asyncio.to_thread(self._release, slot)

    async def reattach(self, rec: SandboxRecord) -> bool:
        if not rec.vm_dir or rec.slot is None:
            return False
        try:
            slot = await asyncio.to_thread(self.pool.adopt, rec.slot, egress_policy(rec))
        except Exception:
            log.warning("sandbox %s: its slot %s is gone", rec.id, rec.slot)
            return False
        try:
            vm = await self.runtime.attach(Path(rec.vm_dir))
        except AttachError:
            await asyncio.to_thread(self._release, slot)
            return False
        envd = EnvdClient(f"http://{slot.host_ip}:{ENVD_PORT}")
        try:
            # A crash in the middle of a snapshot or fork leaves the vCPUs stopped.
            await vm.resume()
            await envd.wait_healthy(5)
        except Exception:
            await vm.stop()
            await asyncio.to_thread(self._release, slot)
            return False
        finally:
            await envd.aclose()
        self._running[rec.id] = _Running(vm, slot, None)
        return True

    async def commit(self, rec: SandboxRecord, ref: str) -> None:
        running = self._running.pop(rec.id, None)
        if running is None or running.disk is None:
            raise InvalidRequest(f"build VM {rec.id} is not running on this node")
        await running.vm.stop()
        await asyncio.to_thread(self._release, running.slot)
        # Under the snapshot lock: a collection scanning the layer store meanwhile would
        # find a layer that no root names yet. The caller pins the reference.
        async with self._snapshot_lock:
            await asyncio.to_thread(disk_layers.commit, running.disk, self.settings.layers_dir,
                                    disk_layers.layer_id(ref))
        await asyncio.to_thread(wd.remove, Path(rec.vm_dir or running.vm.workdir))

    async def pause(self, rec: SandboxRecord, memory: bool, ref: str) -> dict[str, float]:
        """Pause to ``ref``: a VM snapshot (``memory``) or the disk alone; either way the VMM
        ends and the slot is released. Returns the phases, which account for all of the
        call: ``lock``, the capture's steps (finer phases within them) and ``vm_call``, or
        ``disk_pause``; ``log``; then ``finishing_queued`` (a deferred memory write), or
        ``compaction_queue``, ``slot_release``, ``workdir_remove``, ``prestart_queue``,
        ``publish``."""
        running = self._running.get(rec.id)
        if running is None:
            raise InvalidRequest(f"sandbox {rec.id} has no VM on this node")
        directory = self._snapshot_dir(ref)
        timer = PhaseTimer()
        if memory:
            deferred: DeferredMemory | None = None
            async with self._snapshot_lock:
                timer.mark("lock")
                # Not with a shared store: the pause is offered to other nodes (handover)
                # as soon as it answers, so it must be published whole by then. Not for a
                # template's or a build's VM: what makes a template waits for it anyway.
                if self.settings.pause_memory_in_background and self.shared is None and \
                        rec.client_id not in (TEMPLATE_CLIENT, BUILD_CLIENT):
                    info, deferred = await running.vm.pause_deferred(
                        directory, {"slot": running.slot.index, "sandbox": rec.id})
                else:
                    info = await running.vm.snapshot(directory, stop=True)
                timer.add(info.phases)
                timer.mark("vm_call", excluding=info.total_s)
            log.info("sandbox %s: paused to %s (freeze %.0f ms, total %.0f ms, %d KiB "
                     "memory, %d layers%s)", rec.id, directory.name, info.freeze_s * 1000,
                     info.total_s * 1000, info.memory_bytes // 1024, info.memory_layers,
                     ", memory written next" if deferred else "",
                     extra={"sandbox_id": rec.id, "op": "pause", "duration": info.total_s})
            timer.mark("log")
            if deferred is not None:
                self._running.pop(rec.id, None)
                self._start_finishing(deferred, running.slot,
                                      Path(rec.vm_dir or running.vm.workdir), rec.id)
                timer.mark("finishing_queued")
                return timer.phases
            self.compactor.schedule(directory)
            timer.mark("compaction_queue")
        else:
            await self._pause_disk(rec, running, directory)
            timer.mark("disk_pause")
        self._running.pop(rec.id, None)
        await asyncio.to_thread(self._release, running.slot)
        timer.mark("slot_release")
        await asyncio.to_thread(wd.remove, Path(rec.vm_dir or running.vm.workdir))
        timer.mark("workdir_remove")
        if memory and self.vmm_pool is not None:
            # A resume soon after (an agent's pause/resume cycle) then only loads state.
            self.vmm_pool.want_once(directory, RESUME_PRESTART_S)
        timer.mark("prestart_queue")
        await self.publish(directory.name)
        timer.mark("publish")
        return timer.phases

    def _start_finishing(self, deferred: DeferredMemory, slot: NetworkSlot | None,
                         workdir: Path, sandbox: str) -> None:
        name = deferred.directory.name
        self._pending_workdirs[name] = workdir
        self._deferred[name] = (deferred, slot)
        self._pending[name] = asyncio.create_task(
            self._finish_pause(deferred, slot, workdir, sandbox), name=f"aenv-pause-{name}")

    async def _finish_pause(self, deferred: DeferredMemory, slot: NetworkSlot | None,
                            workdir: Path, sandbox: str) -> None:
        """The rest of a pause that answered before its memory was written: the memory
        from the frozen VMM (``DeferredMemory.write``, which then ends the VMM), the slot
        and working directory released, then what a pause does last (compaction queued,
        a VMM pre-started for the resume, published). A failed write is logged: the
        snapshot keeps its ``memory.pending`` marker and a resume of it is refused
        (``_memory_written``); the VMM is ended all the same."""
        directory = deferred.directory
        written = False
        try:
            try:
                async with self._pause_writes:
                    phases = await deferred.write()
                written = True
                log.info("sandbox %s: memory of its pause to %s written (%s)", sandbox,
                         directory.name, ", ".join(f"{k} {v * 1000:.0f} ms"
                                                   for k, v in phases.items()),
                         extra={"sandbox_id": sandbox, "op": "pause_memory",
                                "duration": sum(phases.values())})
            except MemoryWriteAbandoned:
                return  # a resume in place runs that VMM in that slot now
            except Exception as e:
                log.error("sandbox %s: the memory of its pause to %s was not written, it "
                          "cannot be resumed: %s", sandbox, directory.name, e,
                          extra={"sandbox_id": sandbox, "op": "pause_memory"})
            if slot is not None:
                await asyncio.to_thread(self._release, slot)
            await asyncio.to_thread(wd.remove, workdir)
        finally:
            self._pending.pop(directory.name, None)
            if self._deferred.get(directory.name, (None,))[0] is deferred:
                self._deferred.pop(directory.name, None)
                self._pending_workdirs.pop(directory.name, None)
        if written:
            self.compactor.schedule(directory)
            if self.vmm_pool is not None:
                self.vmm_pool.want_once(directory, RESUME_PRESTART_S)
            await self.publish(directory.name)

    async def _memory_written(self, directory: Path) -> None:
        """Before a restore of ``directory``: wait for its pause's memory when it is still
        being written here; ``NotRestorable`` when its marker stays (the write failed, or
        the server stopped during it and the frozen VMM did not survive)."""
        task = self._pending.get(directory.name)
        if task is not None and not snapshot_files.memory_abandoned(directory):
            await asyncio.shield(task)
        if snapshot_files.memory_pending(directory):
            raise NotRestorable(
                f"snapshot {directory.name}: its memory layer is incomplete (the pause's "
                "memory was never finished: the VM that held it is gone); it cannot be "
                "resumed")
        if snapshot_files.memory_abandoned(directory):
            raise NotRestorable(
                f"snapshot {directory.name}: its memory layer is incomplete (a resume "
                "continued its VM in place, then failed and ended it); it cannot be "
                "resumed")

    async def _resume_in_place(self, rec: SandboxRecord, template: TemplateRecord,
                               directory: Path) -> Placement | None:
        """A resume of ``directory`` while its pause's memory is still being written here:
        the write is abandoned (``DeferredMemory.abandon``: stopped within a chunk, the
        marker renamed ``memory.abandoned``, the drives the VM's own again), and the
        frozen VMM continues in the slot and working directory it never left; then what
        every restore ends with (``_restored``: envd's ``/init`` with clock, entropy,
        token, env vars). None when there is no such write, its VMM has no slot, or the
        write is already committing: the caller then waits for it and restores.

        The record's ``restored_from`` names the snapshot the VM derives from (the
        abandoned snapshot's parent), which collection then keeps; the abandoned one goes
        once the record no longer names it. A failure after the abandon ends the VM (the
        snapshot cannot be resumed any more: ``_memory_written`` says why). Phases:
        ``abandon``, ``cont``, ``envd_init``."""
        deferred, slot = self._deferred.get(directory.name, (None, None))
        if deferred is None or slot is None:
            return None
        workdir = self._pending_workdirs.get(directory.name, deferred.vm.workdir)
        timer = PhaseTimer()
        vm = deferred.vm
        try:
            if not await deferred.abandon():
                return None  # the write commits now; it is waited for
        except BaseException:
            self._deferred.pop(directory.name, None)
            self._pending_workdirs.pop(directory.name, None)
            await self._abandon(vm, workdir, slot)
            raise
        self._deferred.pop(directory.name, None)
        self._pending_workdirs.pop(directory.name, None)
        timer.mark("abandon")
        try:
            parent = await asyncio.to_thread(self._parent_ref, directory)
            await vm.resume()
        except BaseException:
            await self._abandon(vm, workdir, slot)
            raise
        timer.mark("cont")
        placement = await self._restored(
            rec, template, vm, slot, workdir, timer,
            f"continued in place in slot {slot.index} (its pause to {directory.name} "
            "abandoned before its memory was written)")
        return dataclasses.replace(placement, restored_from=parent)

    def _parent_ref(self, directory: Path) -> str | None:
        """The reference of the snapshot ``directory`` derives from (a VM resumed in place
        runs on that snapshot's files, as before its pause)."""
        parent = snapshot_files.read_manifest(directory).parent
        return str(ImageRef.snapshot(parent.name)) if parent is not None else None

    async def recover_in_place(self, rec: SandboxRecord,
                               template: TemplateRecord) -> Placement | None:
        """After a restart, for a sandbox left ``resuming``: when its pause snapshot was
        abandoned for a resume in place (``memory.abandoned``), that resume is finished —
        the VMM ``prepare`` kept is adopted in its slot, continued (if the crash came
        before the ``cont``) and given envd's ``/init`` again. None when the snapshot was
        not abandoned; ``NotRestorable`` when it was but the VM did not survive (its memory
        existed nowhere else: the sandbox is lost)."""
        if not rec.snapshot_id:
            return None
        try:
            directory = self._snapshot_dir(rec.snapshot_id)
        except snapshot_store.SnapshotMissing:
            return None
        p = await asyncio.to_thread(snapshot_files.read_pending, directory,
                                    snapshot_files.MEMORY_ABANDONED)
        if p is None:
            return None
        gone = (f"sandbox {rec.id}: the server stopped during its resume in place and its "
                "VM did not survive")
        if not isinstance(p.note.get("slot"), int):
            raise NotRestorable(f"{gone} (no slot recorded)")
        if not p.vm_dir.is_dir():
            # ``prepare`` did not keep the slot then: its index may be another's by now.
            raise NotRestorable(f"{gone} (its working directory is gone)")
        self._in_place_slots.discard(int(p.note["slot"]))
        try:
            slot = await asyncio.to_thread(self.pool.adopt, int(p.note["slot"]),
                                           egress_policy(rec))
        except Exception as e:
            raise NotRestorable(f"{gone} (its slot is gone: {e})") from e
        try:
            vm = await self.runtime.attach(p.vm_dir)
        except AttachError as e:
            await asyncio.to_thread(self._release, slot)
            raise NotRestorable(f"{gone} ({e})") from e
        timer = PhaseTimer()
        try:
            # The abandon's steps once more (a crash may have cut them after the rename).
            await vm.deferred_memory(directory).abandon()
            parent = await asyncio.to_thread(self._parent_ref, directory)
            await vm.resume()
        except Exception as e:
            await self._abandon(vm, p.vm_dir, slot)
            raise NotRestorable(f"{gone} ({e})") from e
        timer.mark("cont")
        try:
            placement = await self._restored(
                rec, template, vm, slot, p.vm_dir, timer,
                f"resume in place finished after a restart, slot {slot.index}")
        except Exception as e:
            raise NotRestorable(f"{gone} (envd: {e})") from e
        return dataclasses.replace(placement, restored_from=parent)

    async def recovered(self) -> None:
        """After the orchestrator's recovery (``Orchestrator.recover``): free each slot
        ``prepare`` kept only for a resume in place that no ``recover_in_place`` took.
        Such a slot is kept whenever an abandoned snapshot names a VMM directory that a
        live record names too; when that record is not resuming from that very snapshot
        (the abandoned snapshot outlived its resume: a crash before its collection, or a
        collection that failed, and the sandbox runs in another slot now), nothing adopts
        it, and it stayed reserved, its network objects kept, until the next restart. An
        index another sandbox leased meanwhile is left alone."""
        unclaimed, self._in_place_slots = sorted(self._in_place_slots), set()
        for index in unclaimed:
            try:
                slot = await asyncio.to_thread(self.pool.adopt, index)
            except Exception:
                continue  # leased by a sandbox it belongs to now, or gone (adopt freed it)
            await asyncio.to_thread(self._release, slot)
            log.info("slot %d: kept for a resume in place that no sandbox finishes; freed",
                     index)

    def _writing_from(self, workdir: Path) -> bool:
        """Whether a pause still writes its memory from the VMM of ``workdir`` (its task
        removes that directory when done)."""
        return workdir in self._pending_workdirs.values()

    def _pending_pauses(self, name: str = snapshot_files.MEMORY_PENDING
                        ) -> list[tuple[Path, snapshot_files.PendingMemory]]:
        """Snapshots whose pause's memory a stopped server had not written (their marker).
        Not a staging directory's: that pause never answered, and its VM, still frozen, is
        re-attached by the orchestrator's recovery (``reattach``). ``name``: another
        marker (``_abandoned_pauses``)."""
        root = self.settings.snapshots_dir
        out = []
        for marker in root.glob(f"*/{name}") if root.is_dir() else ():
            if marker.parent.name.startswith(".") or \
                    not snapshot_store.is_complete(marker.parent):
                continue
            p = snapshot_files.read_pending(marker.parent, name)
            if p is not None:
                out.append((marker.parent, p))
        return out

    def _abandoned_pauses(self) -> list[tuple[Path, snapshot_files.PendingMemory]]:
        """Pause snapshots abandoned for a resume in place (``memory.abandoned``)."""
        return self._pending_pauses(snapshot_files.MEMORY_ABANDONED)

    async def _adopt_pending(self, directory: Path,
                             p: snapshot_files.PendingMemory) -> None:
        """After a restart: write the memory of an interrupted deferred pause from its
        VMM, which waited frozen (``prepare`` kept it and its slot). With the VMM gone the
        marker stays, and a resume of the snapshot is refused with that reason."""
        sandbox = str(p.note.get("sandbox", "?"))
        slot: NetworkSlot | None = None
        if isinstance(p.note.get("slot"), int):
            try:
                slot = await asyncio.to_thread(self.pool.adopt, int(p.note["slot"]))
            except Exception as e:
                log.warning("sandbox %s: the slot of its pausing VMM is gone: %s", sandbox, e)
        try:
            vm = await self.runtime.attach(p.vm_dir)
        except AttachError as e:
            log.error("sandbox %s: the server stopped while writing the memory of its pause "
                      "to %s and the VMM is gone (%s); it cannot be resumed", sandbox,
                      directory.name, e, extra={"sandbox_id": sandbox, "op": "pause_memory"})
            if slot is not None:
                await asyncio.to_thread(self._release, slot)
            await asyncio.to_thread(wd.remove, p.vm_dir)
            return
        log.info("sandbox %s: writing the memory of its pause to %s, interrupted by the "
                 "restart, from its frozen VMM", sandbox, directory.name)
        self._start_finishing(vm.deferred_memory(directory), slot, p.vm_dir, sandbox)

    async def _pause_disk(self, rec: SandboxRecord, running: _Running,
                          directory: Path) -> None:
        """A filesystem-only pause. The snapshot is committed (durably) while the VM is
        only frozen, and the VM ends after that: a failure before the commit thaws the VM
        and leaves its disk where it was; nothing ever holds the only copy in between."""
        disk = self._disk_of(rec, running)
        # Guest I/O stays outside the node-wide lock: a guest that stalls delays its own
        # pause only.
        await self._sync_guest(rec, running)
        async with self._snapshot_lock:
            await running.vm.pause()  # QEMU flushes the block layer when the vCPUs stop
            try:
                await asyncio.to_thread(snapshot_store.save_disk, disk, directory)
            except BaseException:
                if running.vm.is_alive():
                    await running.vm.resume()
                raise
        await running.vm.stop()

    async def update_network(self, rec: SandboxRecord) -> None:
        running = self._running.get(rec.id)
        if running is None:
            raise InvalidRequest(f"sandbox {rec.id} has no VM on this node")
        await asyncio.to_thread(running.slot.set_policy, egress_policy(rec))

    def is_running(self, rec: SandboxRecord) -> bool:
        running = self._running.get(rec.id)
        return running is not None and running.vm.is_alive()

    async def snapshot(self, rec: SandboxRecord, ref: str) -> dict[str, float]:
        """Phases, which account for all of the call: ``lock`` (waiting for other
        captures and collection), the capture's steps (``aenv.runtime.snapshot_recipe``,
        with their finer phases within them), ``vm_call`` (the driver's call beyond its
        steps), ``compaction_queue``, ``log``, ``publish``."""
        running = self._running.get(rec.id)
        if running is None:
            raise InvalidRequest(f"sandbox {rec.id} has no VM on this node")
        timer = PhaseTimer()
        async with self._snapshot_lock:
            timer.mark("lock")
            info = await running.vm.snapshot(self._snapshot_dir(ref), stop=False)
            timer.add(info.phases)
            timer.mark("vm_call", excluding=info.total_s)
        self.compactor.schedule(info.directory)
        timer.mark("compaction_queue")
        log.info("sandbox %s: snapshot %s (freeze %.0f ms, total %.0f ms)", rec.id,
                 ref, info.freeze_s * 1000, info.total_s * 1000,
                 extra={"sandbox_id": rec.id, "op": "snapshot", "duration": info.total_s})
        timer.mark("log")
        await self.publish(self._snapshot_dir(ref).name)
        timer.mark("publish")
        return timer.phases

    # -- the shared store (a cluster's) ---------------------------------------------------

    def offers(self) -> dict[str, Any]:
        """What this node restores (``shared_store.incompatibilities`` reads it)."""
        kernels = self.settings.kernels_dir
        names = [p.name for p in kernels.iterdir()] if kernels.is_dir() else []
        return {**restores(self.settings), "kernels": sorted(names)}

    async def publish(self, snapshot_id: str) -> None:
        """Publish a snapshot just written to the shared store (when there is one). A
        failure is logged: the snapshot stays usable here, only not elsewhere."""
        if self.shared is None:
            return
        roots = shared_store.LocalRoots(self.settings.snapshots_dir, self.settings.layers_dir,
                                        self.settings.images_dir)
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.shared.publish, roots, snapshot_id)
        except (OSError, StorageError) as e:
            log.error("snapshot %s: not published to the shared store: %s", snapshot_id, e)
            return
        log.info("snapshot %s: published to the shared store in %.2f s", snapshot_id,
                 time.monotonic() - started)

    def restorable(self, requires: dict[str, Any]) -> list[str]:
        """Why this node cannot restore a snapshot that ``requires`` (empty: it can)."""
        return shared_store.incompatibilities(requires, self.offers())

    async def fetch(self, snapshot_id: str) -> None:
        """Bring a snapshot this node lacks from the shared store, verified; refuse one it
        cannot restore (``NotRestorable``). Nothing to do without a shared store or when
        the store lacks it. Under the snapshot lock: collection must not see a fetched
        dependency before the snapshot that reaches it."""
        if self.shared is None or not self.shared.has(snapshot_id):
            return
        roots = shared_store.LocalRoots(self.settings.snapshots_dir, self.settings.layers_dir,
                                        self.settings.images_dir)
        started = time.monotonic()
        async with self._snapshot_lock:
            try:
                await asyncio.to_thread(self.shared.fetch, roots, snapshot_id, self.offers())
            except shared_store.Incompatible as e:
                raise NotRestorable(str(e)) from e
        log.info("snapshot %s: fetched from the shared store in %.2f s", snapshot_id,
                 time.monotonic() - started)

    async def collect(self, roots: Callable[[], set[str]]) -> int:
        async with self._snapshot_lock:
            try:
                keep = roots()
                dropped = await self._drop_unnamed_writes(keep)
                removed = await asyncio.to_thread(
                    snapshot_store.collect, self.settings.snapshots_dir,
                    self.settings.layers_dir,
                    keep | {str(ImageRef.snapshot(name)) for name in self._pending
                            if name not in dropped})
                # The cached empty overlays of what was just deleted go with it.
                await asyncio.to_thread(disks.prune_overlay_cache, self.settings.vms_dir)
            except snapshot_store.DependenciesUnknown as e:
                log.error("garbage collection deleted nothing: %s", e)
                return 0
        if removed and self.vmm_pool is not None:  # a deleted template's VMMs go too
            await self.vmm_pool.prune()
        return len(removed)

    async def _drop_unnamed_writes(self, keep: set[str]) -> set[str]:
        """Abandon every deferred pause's memory write whose snapshot is not in ``keep``
        (collection's roots: no live record names it and no operation pinned it, as after
        a kill of the paused sandbox): its VMM ends, its slot and working directory are
        released now, not after a write nobody would read. Returns the snapshot names
        dropped (collectable at once). A write already committing (``abandon`` is False)
        finishes as usual and is collected at a later pass; a deferred pause of a driver
        that cannot abandon, likewise. An abandon that fails ends the VMM all the same (as
        ``_resume_in_place``'s: the write may have stopped, and would then release nothing)."""
        dropped: set[str] = set()
        for name, (deferred, slot) in list(self._deferred.items()):
            if str(ImageRef.snapshot(name)) in keep:
                continue
            try:
                if not await deferred.abandon():
                    continue
            except Exception:  # the write may have stopped already: end the VM all the same
                log.exception("snapshot %s: abandoning its unused memory write failed; "
                              "its VMM is ended anyway", name)
            workdir = self._pending_workdirs.get(name, deferred.vm.workdir)
            if self._deferred.get(name, (None,))[0] is deferred:
                self._deferred.pop(name, None)
                self._pending_workdirs.pop(name, None)
            await deferred.vm.stop()
            await asyncio.to_thread(wd.remove, workdir)
            if slot is not None:
                await asyncio.to_thread(self._release, slot)
            dropped.add(name)
            log.info("snapshot %s: named by nothing any more (its sandbox ended), its "
                     "memory write abandoned and its VMM ended", name,
                     extra={"op": "pause_memory"})
        return dropped

    def _disk_of(self, rec: SandboxRecord, running: _Running) -> Disk:
        """The root disk file the VM writes now: after a running snapshot that is a new
        overlay, not the file it was started with."""
        path = running.vm.active_drive("rootfs")
        fmt: Literal["raw", "qcow2"] = "qcow2" if path.suffix == ".qcow2" else "raw"
        base = running.disk.base if running.disk is not None else path
        return Disk(path, fmt, "qcow2" if fmt == "qcow2" else "reflink", base)

    async def _sync_guest(self, rec: SandboxRecord, running: _Running) -> None:
        """Flush the guest's page cache to its disk before the disk is kept."""
        envd = EnvdClient(f"http://{running.slot.host_ip}:{ENVD_PORT}", rec.envd_token)
        try:
            await envd.run("sync", user="root", timeout=GUEST_SYNC_TIMEOUT_S)
        finally:
            await envd.aclose()

    def logs(self, rec: SandboxRecord, start: int | None, limit: int) -> list[dict[str, Any]]:
        """The VM's serial console, one entry per line (timestamps: the file's mtime)."""
        if not rec.vm_dir:
            return []
        path = Path(rec.vm_dir) / wd.CONSOLE
        try:
            text = path.read_text(errors="replace")
            ts = int(path.stat().st_mtime * 1000)
        except OSError:
            return []
        lines = text.splitlines()[(start or 0):][:limit]
        return [{"timestamp": ts, "line": line} for line in lines]
