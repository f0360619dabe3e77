"""The Firecracker driver: one ``firecracker`` process per VM, driven over its API socket.

Targets the published API of Firecracker **v1.16.1** and needs at least v1.14 (the first
with ``PUT /serial``; ``network_overrides`` on load came in 1.12 and ``/entropy`` in 1.4, so
both are always there). Requires hardware KVM: Firecracker has no software fallback.

Boot: the working directory is prepared with the fixed names of ``aenv.runtime.workdir``
(``kernel``, ``initrd``, ``<drive>.raw``, ``console.log``); ``firecracker --api-sock
firecracker.sock`` starts there (cwd = working directory, inside the slot's netns through
``nsenter``, own session and process group, stdout/stderr appended to ``vmm.log``, pid in
``vmm.pid``). Once the socket answers ``GET /version`` the driver sends, in this order:
``PUT /logger`` (only when a log level is configured), ``PUT /metrics`` (only when enabled),
``PUT /serial`` (console -> ``console.log``), ``PUT /machine-config``, ``PUT /boot-source``,
``PUT /drives/<id>`` for each drive (root first), ``PUT /network-interfaces/eth0``,
``PUT /entropy`` and ``PUT /actions InstanceStart``. Every path in a request is relative
to the VMM's cwd, so the microVM state never names a sandbox's own directory.

Snapshot (the steps of ``FirecrackerCapture``, run by the shared recipe of
``aenv.runtime.snapshot_recipe``): ``PATCH /vm Paused`` (if it ran), ``PUT /snapshot/create``
into a staging directory of ``aenv.storage.snapshots``, writable drives copied beside it
while the vCPUs are still frozen (reflink where possible), then ``PATCH /vm Resumed`` and the
manifest committed (for ``stop``: the manifest committed, then the VMM ended);
``aenv.runtime.firecracker_snapshot`` decides Full or Diff and is the one place that knows
Firecracker's two files. Restore: a new process in a new working directory, the drives under
their fixed names, then ``PUT /snapshot/load`` with the ``File`` memory backend (Firecracker
maps the file ``MAP_PRIVATE``: pages are read lazily and copied on write, so VMs from one
snapshot share its page cache), ``network_overrides`` for the new tap and ``resume_vm``.
Failures of either are ``SnapshotError``.

Stop: SIGTERM to the process group (Firecracker installs no SIGTERM handler, so it exits at
once), SIGKILL after the timeout. ``SendCtrlAltDel`` is not used: it needs the guest's i8042
and AT-keyboard drivers, which the small guest kernel (``kconfig/small.txt``) does not build,
and a guest shutdown would buy nothing (a sandbox disk is discarded or captured by a
snapshot, and Firecracker's writes are in the host page cache either way).

Jailer (``aenv.runtime.firecracker_jail``): when a ``jailer`` binary is given or on PATH and
the server is root, Firecracker is started through it: its own uid, the VMM group, a chroot
of ``<workdir>/jail/firecracker/<id>/root`` holding hard links of what it opens (under the
same fixed names, so every request path stays the same), a cgroup made beforehand with the
VM's limits (``aenv.runtime.confine``), the slot's netns and resource limits. Snapshots are
written inside the jail and moved out; a restore links the snapshot's files in. Without a
jailer Firecracker runs as the server does (logged once).

Drives must be raw files: Firecracker has no qcow2, so a spec with a qcow2 drive is refused
before anything starts (``create_disk`` makes raw disks only where the data directory can
reflink, e.g. XFS or btrfs). Guest RAM is always Firecracker's own anonymous memory;
``VMSpec.memory_file`` is refused with ``NotSupportedError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..phase_timer import PhaseTimer
from ..storage import snapshots
from . import confine, snapshot_recipe
from . import firecracker_api as fc
from . import firecracker_jail as fj
from . import firecracker_snapshot as fcsnap
from . import workdir as wd
from .base import (
    VM,
    AttachError,
    BootError,
    ControlError,
    MachineRecordError,
    NotSupportedError,
    RestoreOverrides,
    Runtime,
    SnapshotError,
    SnapshotInfo,
    VMError,
    VMExitedError,
    VMLimits,
    VMSpec,
)
from .cgroups import VMCgroup
from .confine import Confinement, Jail
from .firecracker_snapshot import FirecrackerMachine
from .kvm import AccelChoice, host_accel
from .qemu_args import netns_path
from .snapshot_recipe import Capture, Captured, CaptureSteps
from .vmm_process import NotOurProcessError, VMMProcess

log = logging.getLogger("aenv.runtime")

BINARY = "firecracker"
API_SOCKET = "firecracker.sock"
_JAIL_SNAPSHOT = "snapshot"  # where a jailed Firecracker writes a snapshot (in its root)
METRICS = "metrics.json"
IFACE_ID = "eth0"
API_TIMEOUT = 5.0  # seconds from spawn until the API socket must answer
LOAD_TIMEOUT = 60.0  # PUT /snapshot/load (maps memory, restores devices)
SNAPSHOT_TIMEOUT = 600.0  # PUT /snapshot/create writes (up to) all of guest RAM
# Kernel arguments that only QEMU under TCG should give a guest (``qemu_args``), dropped if a
# caller passes them: Firecracker always runs on KVM, where the guest uses kvm-clock.
_TCG_ONLY_ARGS = ("tsc_early_khz=", "tsc=reliable")
_ELF_MAGIC = b"\x7fELF"


def firecracker_binary() -> str | None:
    return shutil.which(BINARY)


def firecracker_version(binary: str) -> str | None:
    """``1.16.1`` from ``firecracker --version`` (first line ``Firecracker v1.16.1``)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.splitlines()[0] if out.strip() else ""
    return first.split()[-1].removeprefix("v") if first else None


def build_argv(binary: str, netns: str | None) -> list[str]:
    """``[nsenter --net=<ns> --] firecracker --api-sock firecracker.sock``.

    nsenter calls setns and execs, so the VMM keeps its pid (the one in ``vmm.pid``).
    """
    prefix = ["nsenter", f"--net={netns_path(netns)}", "--"] if netns else []
    return [*prefix, binary, "--api-sock", API_SOCKET]


def boot_args(args: str) -> str:
    """The guest command line as Firecracker gets it: TCG-only clock arguments dropped,
    ``reboot=k`` added (the guest's reboot then resets through the keyboard controller
    port, which makes Firecracker exit, as its docs recommend)."""
    tokens = [t for t in args.split()
              if not any(t.startswith(a) for a in _TCG_ONLY_ARGS)]
    if not any(t.startswith("reboot=") for t in tokens):
        tokens.append("reboot=k")
    return " ".join(tokens)


def doctor_checks() -> list[tuple[str, str]]:
    """Three rows: the binary, whether /dev/kvm can run Firecracker, and what is missing."""
    binary = firecracker_binary()
    version = firecracker_version(binary) if binary else None
    missing = []
    if binary is None:
        found = "not found on PATH"
        missing.append("a firecracker binary (v1.14 or newer) on PATH")
    else:
        found = f"{binary} {version or '(version unknown)'}"
        try:
            too_old = version is None or fc.parse_version(version) < fc.MIN_VERSION
        except ValueError:
            too_old = True
        if too_old:
            missing.append(f"firecracker v1.14 or newer (found {version or 'unknown'})")
    choice = host_accel()
    kvm = f"usable: {choice.reason}" if choice.accel == "kvm" else f"unusable: {choice.reason}"
    if choice.accel != "kvm":
        missing.append("hardware KVM")
    return [
        ("firecracker", found),
        ("firecracker kvm", kvm),
        ("firecracker runtime", "ready" if not missing else "missing " + "; ".join(missing)),
    ]


def _rel(path: Path, workdir: Path) -> str:
    """``path`` as the VMM (cwd = ``workdir``) names it."""
    return os.path.relpath(path.resolve(), workdir.resolve())


@dataclass
class _Launch:
    """How one Firecracker is started: its argv, where its API socket appears, its jail
    (released when it ends) and the directory its relative paths resolve in (its cwd: the
    working directory, or the jail root)."""

    argv: list[str]
    api_socket: Path
    jail: Jail
    root: Path
    jailed: bool

    def path(self, host: Path, name: str, workdir: Path, *, own: bool) -> str:
        """``host`` as Firecracker names it: relative to the working directory, or linked
        into the jail as ``name``."""
        if not self.jailed:
            return _rel(host, workdir)
        fj.expose(host, self.root / name, self.jail, own=own)
        return name


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass
class FirecrackerPrestarted:
    """A restore's Firecracker up to its snapshot load (``FirecrackerRuntime.prestart``):
    spawned (jailed) in its slot's netns, API socket answering, drives and memory in
    place; ``load`` is the ``PUT /snapshot/load`` that ``activate`` sends."""

    vm: FirecrackerVM
    load: fc.Request
    snapshot_dir: Path
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def vm_id(self) -> str:
        return self.vm.vm_id

    @property
    def workdir(self) -> Path:
        return self.vm.workdir

    def is_alive(self) -> bool:
        return self.vm.is_alive()

    @property
    def returncode(self) -> int | None:
        return self.vm.returncode


def _restore_error(e: BaseException, snapshot_dir: Path, vm_id: str) -> BaseException:
    """What a failed restore step raises: ``SnapshotError`` (the cause chained), or the
    error itself when it is none of the VMM's (a cancellation)."""
    if isinstance(e, SnapshotError):
        return e
    if isinstance(e, BootError):
        err = SnapshotError(f"restore of {snapshot_dir} failed: {e.args[0]}", vm_id=vm_id,
                            vmm_log_tail=e.vmm_log_tail)
        err.__cause__ = e.__cause__ or e
        return err
    if isinstance(e, (OSError, snapshots.SnapshotFilesError, VMError)):
        err = SnapshotError(f"restore of {snapshot_dir} failed: {e}", vm_id=vm_id)
        err.__cause__ = e
        return err
    return e


class FirecrackerVM(VM):
    """Handle on one Firecracker process. ``boot_timings`` holds seconds since spawn:
    ``api_ready`` (socket answered), ``configured`` and ``qmp_ready`` (InstanceStart
    returned: the guest runs; the name is the one ``ready.BootPhases`` reads)."""

    def __init__(self, *, vm_id: str, workdir: Path, process: VMMProcess,
                 api: fc.FirecrackerAPI, record: dict[str, Any], started_at: float,
                 boot_timings: dict[str, float] | None = None, jail: Jail | None = None,
                 root: Path | None = None) -> None:
        self.vm_id = vm_id
        self.workdir = workdir
        self.accel = "kvm"
        self.accel_reason = record.get("accel_reason", "")
        self.console_log = workdir / wd.CONSOLE
        self.started_at = started_at
        self.boot_timings = boot_timings or {}
        self._process = process
        self._api = api
        self._record = record  # the working directory's vm.json
        # the machine record (goes into every snapshot manifest)
        self.machine = FirecrackerMachine.from_json(record["machine"], workdir / wd.MANIFEST)
        self.jail = jail or Jail(vm_id, workdir, released=True)
        self._root = root or workdir  # Firecracker's cwd

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def memory_parent(self) -> Path | None:
        """The snapshot whose memory this VM's dirty-page log is relative to, or None."""
        parent = self._record.get("memory_parent")
        return Path(parent) if parent else None

    def is_alive(self) -> bool:
        return self._process.is_alive()

    @property
    def returncode(self) -> int | None:
        """Firecracker's exit status once it has exited (None while it runs, or adopted)."""
        return self._process.returncode

    async def _call(self, request: fc.Request, *, timeout: float | None = None) -> Any:
        if not self._process.is_alive():
            raise VMExitedError(f"Firecracker of {self.vm_id} has exited", vm_id=self.vm_id)
        try:
            return await self._api.send(request, timeout=timeout)
        except fc.APIConnectionError as e:
            try:
                await asyncio.wait_for(self._process.wait(), 0.5)
            except TimeoutError:
                raise e from None
            raise VMExitedError(f"Firecracker of {self.vm_id} exited during "
                                f"{request.method} {request.path}", vm_id=self.vm_id) from e

    async def status(self) -> str:
        """Firecracker's instance state: ``Not started``, ``Running`` or ``Paused``."""
        info = await self._call(fc.describe_instance())
        return str(info["state"])

    async def pause(self) -> None:
        t = PhaseTimer()
        await self._call(fc.patch_vm("Paused"))
        log.info("paused", extra={"vm_id": self.vm_id, "op": "pause",
                                  "duration": t.elapsed()})

    async def resume(self) -> None:
        t = PhaseTimer()
        await self._call(fc.patch_vm("Resumed"))
        log.info("resumed", extra={"vm_id": self.vm_id, "op": "resume",
                                   "duration": t.elapsed()})

    async def snapshot(self, directory: Path, *, stop: bool = False,
                       incremental: bool = True) -> SnapshotInfo:
        """Capture the VM into ``directory`` (see ``VM.snapshot``): the recipe of
        ``aenv.runtime.snapshot_recipe`` with ``FirecrackerCapture``'s steps.

        A running VM is paused for the capture (``PATCH /vm``), then resumed, or ended with
        ``stop``; a VM the caller had paused stays paused. The vCPUs stay frozen until the
        writable drives are copied too, so disk and memory are of one moment.
        ``incremental`` asks for a Diff against the snapshot this VM last took or was
        restored from; ``firecracker_snapshot.plan`` decides when that is possible."""
        return await snapshot_recipe.capture(FirecrackerCapture(self), directory, stop=stop,
                                             incremental=incremental)

    def _set_memory_parent(self, parent: Path | None) -> None:
        self._record["memory_parent"] = str(parent) if parent else None
        _write_json(self.workdir / wd.MANIFEST, self._record)

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout``; leaves the working
        directory (see ``workdir.remove``)."""
        t = PhaseTimer()
        await self._process.terminate(timeout)
        await self._api.aclose()
        self._process.close()
        if not self._process.is_alive():
            await asyncio.to_thread(self.jail.release)
        log.info("stopped", extra={"vm_id": self.vm_id, "op": "stop",
                                   "duration": t.elapsed()})

    async def wait(self) -> int | None:
        return await self._process.wait()

    async def detach(self) -> None:
        """Drop the API connection but leave the VMM running (server shutdown)."""
        await self._api.aclose()


class FirecrackerCapture(CaptureSteps):
    """``FirecrackerVM.snapshot`` as the steps of ``aenv.runtime.snapshot_recipe``.
    Firecracker writes state and memory in one call (``PUT /snapshot/create``, in
    ``save_state``); which layer the memory file becomes is sorted out after the thaw, in
    ``commit``. ``phases``: ``pause``, ``create``, ``drives``, ``resume`` (when it ran
    and goes on), ``stop`` (a pause: the VMM ended; ``freeze_s`` counts until then)."""

    def __init__(self, vm: FirecrackerVM) -> None:
        self.vm = vm
        self.vm_id = vm.vm_id
        self.workdir = vm.workdir
        self.was_running = False

    def is_alive(self) -> bool:
        return self.vm.is_alive()

    async def plan(self, c: Capture) -> None:
        """Whether it runs; the staging directory; Full or Diff against the snapshot the
        dirty-page log is relative to (a merged Diff clones the parent's memory now)."""
        vm = self.vm
        self.parent_dir = vm.memory_parent
        parent = _readable_manifest(self.parent_dir)
        self.was_running = await vm.status() == "Running"
        self.staging = staging = snapshots.begin(c.directory)
        c.undo.push("the staging directory", lambda: snapshots.abort(staging))
        self.memory_plan = await asyncio.to_thread(
            fcsnap.plan, staging, parent, self.parent_dir, incremental=c.incremental,
            track_dirty_pages=vm.machine.track_dirty_pages)

    async def freeze(self, c: Capture) -> None:
        if self.was_running:
            c.undo.push("the freeze", self._unfreeze)
            await self.vm._call(fc.patch_vm("Paused"))

    async def _unfreeze(self) -> None:
        """The freeze's undo: the vCPUs run again, if the VMM is there."""
        if self.vm.is_alive():
            await self.vm._call(fc.patch_vm("Resumed"))

    async def save_state(self, c: Capture) -> None:
        """``PUT /snapshot/create``: microVM state and memory. A successful create resets
        Firecracker's dirty log, so until this snapshot is committed no snapshot is a valid
        base for a diff; a refused one changes nothing."""
        vm = self.vm
        vm._set_memory_parent(None)
        paths = await asyncio.to_thread(self._paths, self.staging)
        try:
            await vm._call(fc.create_snapshot(*paths, self.memory_plan.snapshot_type),
                           timeout=SNAPSHOT_TIMEOUT)
        except fc.FirecrackerAPIError:
            vm._set_memory_parent(self.parent_dir)
            raise
        finally:
            await asyncio.to_thread(self._out_of_jail, self.staging)

    async def save_memory(self, c: Capture) -> None:
        """Nothing: ``save_state``'s create wrote the memory file too."""

    async def drives(self, c: Capture) -> None:
        self.images, self.disk_bytes = await asyncio.to_thread(self._copy_drives,
                                                               self.staging)

    async def thaw(self, c: Capture) -> None:
        if self.was_running and not c.stop:
            await self.vm._call(fc.patch_vm("Resumed"))
            c.undo.drop("the freeze")

    async def commit(self, c: Capture) -> Captured:
        """The layers the memory file makes (a diff layer's runs are read from its
        extents), the bytes it wrote, the manifest and ``snapshots.commit``."""
        vm, plan, staging = self.vm, self.memory_plan, self.staging
        layers = await asyncio.to_thread(fcsnap.finish_memory, plan, staging, c.directory)
        memory_bytes = await asyncio.to_thread(fcsnap.written_bytes, plan, staging, layers)
        manifest = snapshots.Manifest(
            driver=fcsnap.DRIVER, vm=vm.machine.to_json(), memory_size=vm.machine.memory_size,
            layers=layers, drives=self.images, parent=plan.parent,
            sizes={"vmstate": (staging / fcsnap.VMSTATE).stat().st_size,
                   "memory_written": memory_bytes, "disk_written": self.disk_bytes},
            timings=c.phases)
        snapshots.commit(staging, c.directory, manifest)
        return Captured(parent=plan.parent, memory_bytes=memory_bytes,
                        memory_layers=len(layers), disk_bytes=self.disk_bytes,
                        compacted=plan.compacted, method=plan.method)

    async def finish(self, c: Capture) -> None:
        """The dirty log is relative to this snapshot now; a pause ends the VMM, frozen
        until it is gone."""
        self.vm._set_memory_parent(c.directory)
        if c.stop:
            c.vmm_stopped = True
            c.frozen_until_finish = True
            await self.vm.stop()

    def _paths(self, staging: Path) -> tuple[str, str]:
        """Where ``/snapshot/create`` writes, as Firecracker names it. Jailed, that is a
        directory in its jail (a merged diff's clone of the parent memory moved in and
        given to its uid first); ``_out_of_jail`` moves the files to ``staging``."""
        vm = self.vm
        if vm._root == vm.workdir:
            return (_rel(staging / fcsnap.VMSTATE, vm.workdir),
                    _rel(staging / fcsnap.MEMORY, vm.workdir))
        inner = vm._root / _JAIL_SNAPSHOT
        shutil.rmtree(inner, ignore_errors=True)
        inner.mkdir()
        vm.jail.give(inner, 0o700)
        if (staging / fcsnap.MEMORY).exists():
            fj.move_out(staging / fcsnap.MEMORY, inner / fcsnap.MEMORY)
            vm.jail.give(inner / fcsnap.MEMORY, 0o600)
        return (f"{_JAIL_SNAPSHOT}/{fcsnap.VMSTATE}", f"{_JAIL_SNAPSHOT}/{fcsnap.MEMORY}")

    def _out_of_jail(self, staging: Path) -> None:
        """The files a jailed create wrote, moved to ``staging`` and given back to root."""
        vm = self.vm
        if vm._root == vm.workdir:
            return
        inner = vm._root / _JAIL_SNAPSHOT
        for name in (fcsnap.VMSTATE, fcsnap.MEMORY):
            if (inner / name).exists():
                fj.move_out(inner / name, staging / name)
                fj.take_back_shared(staging / name)
        shutil.rmtree(inner, ignore_errors=True)

    def _copy_drives(self, staging: Path) -> tuple[tuple[snapshots.DriveImage, ...], int]:
        """Read-only drives are referenced where they are; writable ones are copied
        (reflink where the filesystem can) as the snapshot's own file. Returns the images
        and the bytes copied."""
        images, copied = [], 0
        for d in self.vm.machine.drives:
            name = f"{d.id}.raw"
            host = (self.vm.workdir / name).resolve()
            if d.read_only:
                images.append(snapshots.DriveImage(d.id, "raw", True, path=host))
                continue
            copied += fcsnap.clone(host, staging / name)[1]
            images.append(snapshots.DriveImage(d.id, "raw", False, file=name))
        return tuple(images), copied


class FirecrackerRuntime(Runtime):
    """``log_level`` sends ``PUT /logger`` (Firecracker's log is on its stdout, in
    ``vmm.log``); ``metrics`` sends ``PUT /metrics`` to ``metrics.json``;
    ``track_dirty_pages`` turns on KVM dirty-page tracking (needed for incremental
    snapshots, at a small cost on every guest write)."""

    name = "firecracker"

    def __init__(self, *, binary: str | None = None, accel: AccelChoice | None = None,
                 log_level: fc.LogLevel | None = None, metrics: bool = False,
                 track_dirty_pages: bool = True, jailer: str | None = None,
                 confinement: Confinement | None = None) -> None:
        """``jailer``: the jailer binary (default: ``jailer`` on PATH); it is used when the
        server is root and ``confinement.unprivileged``."""
        self._binary = binary
        self._accel = accel
        self.log_level = log_level
        self.metrics = metrics
        self.track_dirty_pages = track_dirty_pages
        self._jailer = jailer
        self.confinement = confinement if confinement is not None else Confinement()

    def jailer_binary(self) -> str | None:
        """The jailer this runtime starts Firecracker through, or None (unjailed)."""
        if not self.confinement.unprivileged:
            return None
        jailer = self._jailer or fj.jailer_binary()
        if jailer is None or os.geteuid() != 0:
            confine._warn_once("Firecracker runs unjailed, as the server's user: "
                               + ("no jailer binary on PATH" if jailer is None
                                  else "the jailer needs root"))
            return None
        return jailer

    def cleanup_leftovers(self, vms_dir: Path, keep: set[str]) -> dict[str, list[str]]:
        return confine.cleanup_leftovers(self.confinement, vms_dir, keep)

    def _launch(self, vm_id: str, workdir: Path, netns: str | None, binary: str, *,
                vcpus: int, memory_mib: int, limits: VMLimits | None,
                largest_file: int) -> _Launch:
        """Plain ``[nsenter] firecracker``, or the jailer with a uid, cgroup and jail root
        made for this VM (blocking)."""
        jailer = self.jailer_binary()
        if jailer is None:
            return _Launch(build_argv(binary, netns), workdir / API_SOCKET,
                           Jail(vm_id, workdir, released=True), workdir, False)
        binary = os.path.abspath(binary)
        layout = fj.JailLayout.of(workdir, vm_id, binary)
        try:
            jail = confine.prepare(self.confinement, vm_id, workdir, vcpus=vcpus,
                                   memory_mib=memory_mib, overrides=limits,
                                   cgroup_at_root=True)
        except confine.ConfinementError as e:
            raise BootError(f"cannot confine the VMM of {vm_id}: {e}", vm_id=vm_id) from e
        jail.seccomp = jail.chroot = True  # Firecracker's own filters; the jailer's root
        try:
            fj.make_root(layout, jail)
            cgroup = None
            if jail.cgroup is not None and jail.limits is not None:
                hierarchies = self.confinement.hierarchies(at_root=True)
                cgroup, used = fj.cgroup_args(hierarchies, jail.limits)
                # the VMM will be only where the jailer puts it
                dirs = dict(zip(hierarchies.hierarchies, jail.cgroup.dirs, strict=True))
                VMCgroup(vm_id, tuple(d for h, d in dirs.items() if h not in used)).remove()
                jail.cgroup = VMCgroup(vm_id, tuple(dirs[h] for h in used)) if used else None
                if not used:
                    cgroup = None
            argv = fj.build_argv(
                jailer, binary, vm_id, jail, layout,
                netns=netns_path(netns) if netns else None, cgroup=cgroup,
                rlimits=fj.resource_limits(memory_mib, largest_file), api_socket=API_SOCKET)
        except BaseException:
            jail.release()
            raise
        return _Launch(argv, layout.root / API_SOCKET, jail, layout.root, True)

    @property
    def accel(self) -> AccelChoice:
        return self._accel or host_accel()

    def _binary_or_raise(self, vm_id: str) -> str:
        """The binary to run, after checking the host can run it at all."""
        binary = self._binary or firecracker_binary()
        if binary is None:
            raise BootError(f"no {BINARY} binary on PATH", vm_id=vm_id)
        if self.accel.accel != "kvm":
            raise BootError(f"Firecracker needs hardware KVM: {self.accel.reason}", vm_id=vm_id)
        return binary

    @staticmethod
    def check_spec(spec: VMSpec) -> None:
        """Refuse what Firecracker cannot do, before anything is created or started."""
        for drive in spec.drives:
            if drive.format != "raw":
                raise NotSupportedError(
                    f"drive {drive.id} ({drive.path}) is {drive.format}: Firecracker opens raw "
                    "files only (give the data directory a reflink-capable filesystem such as "
                    "XFS or btrfs, so sandbox disks are raw reflinks)", vm_id=spec.vm_id)
        if spec.memory_file is not None:
            raise NotSupportedError("Firecracker boots with its own anonymous guest memory; "
                                    "VMSpec.memory_file must be None", vm_id=spec.vm_id)
        try:
            with open(spec.kernel, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise BootError(f"cannot read kernel {spec.kernel}: {e.strerror}",
                            vm_id=spec.vm_id) from e
        if magic != _ELF_MAGIC:
            raise BootError(f"kernel {spec.kernel} is not an uncompressed vmlinux (ELF), "
                            "which Firecracker v1.16 needs on x86_64", vm_id=spec.vm_id)

    def _observability(self) -> list[fc.Request]:
        """Requests that may precede both a boot and a snapshot load (Firecracker does not
        keep them in a snapshot). The load docs name only logger and metrics as allowed
        before it; v1.16.1 also accepts ``/serial`` there (it does not mark the process as
        booting) and applies it to the restored serial device, which this relies on."""
        requests = []
        if self.log_level is not None:
            requests.append(fc.put_logger(self.log_level))
        if self.metrics:
            requests.append(fc.put_metrics(METRICS))
        requests.append(fc.put_serial(wd.CONSOLE))
        return requests

    async def boot(self, spec: VMSpec) -> FirecrackerVM:
        self.check_spec(spec)
        binary = self._binary_or_raise(spec.vm_id)
        wd.prepare(spec)
        machine = FirecrackerMachine(
            vcpus=spec.vcpus, memory_mib=spec.memory_mib,
            track_dirty_pages=self.track_dirty_pages, kernel=spec.kernel.resolve(),
            initrd=spec.initrd.resolve() if spec.initrd else None,
            boot_args=boot_args(spec.boot_args),
            drives=tuple(fcsnap.MachineDrive(d.id, d.read_only, root=i == 0)
                         for i, d in enumerate(spec.drives)),
            network=fcsnap.MachineNetwork(IFACE_ID, spec.tap, spec.mac) if spec.tap else None)
        requests = [
            *self._observability(),
            fc.put_machine_config(spec.vcpus, spec.memory_mib,
                                  track_dirty_pages=self.track_dirty_pages),
            fc.put_boot_source(wd.KERNEL, machine.boot_args,
                               wd.INITRD if spec.initrd else None),
            *(fc.put_drive(d.id, wd.drive_name(d), is_root_device=i == 0,
                           is_read_only=d.read_only) for i, d in enumerate(spec.drives)),
        ]
        if spec.tap:
            requests.append(fc.put_network_interface(IFACE_ID, spec.tap, spec.mac))
        requests.append(fc.put_entropy())
        launch = await asyncio.to_thread(
            self._launch, spec.vm_id, spec.workdir, spec.netns, binary, vcpus=spec.vcpus,
            memory_mib=spec.memory_mib, limits=spec.limits,
            largest_file=max((os.path.getsize(d.path) for d in spec.drives), default=0))
        if launch.jailed:
            try:
                await asyncio.to_thread(self._fill_jail, spec, launch)
            except BaseException:
                await asyncio.to_thread(launch.jail.release)
                raise
        vm, t_configured = await self._start(
            spec.vm_id, spec.workdir, launch, machine, requests, restored_from=None)
        t = PhaseTimer()
        try:
            await vm._call(fc.instance_start())
        except BaseException as e:
            error = await self._failed(vm, e, "InstanceStart failed")
            if error is e:
                raise
            raise error from e
        t.mark("instance_start")
        vm.boot_timings.update(configured=t_configured,
                               qmp_ready=t_configured + t.phases["instance_start"])
        log.info("booted %s in %.0f ms (pid %d, InstanceStart %.0f ms)", spec.vm_id,
                 vm.boot_timings["qmp_ready"] * 1000, vm.pid, t.phases["instance_start"] * 1000,
                 extra={"vm_id": spec.vm_id, "op": "boot", "phase": "instance_start",
                        "duration": vm.boot_timings["qmp_ready"]})
        return vm

    @staticmethod
    def _fill_jail(spec: VMSpec, launch: _Launch) -> None:
        """Hard links of what a booting Firecracker opens, under the fixed names."""
        root, jail = launch.root, launch.jail
        fj.expose(spec.kernel, root / wd.KERNEL, jail, own=False)
        if spec.initrd is not None:
            fj.expose(spec.initrd, root / wd.INITRD, jail, own=False)
        for d in spec.drives:
            name = wd.drive_name(d)
            fj.expose(spec.workdir / name, root / name, jail, own=not d.read_only,
                      writable=not d.read_only)
        fj.expose_console(spec.workdir, root, jail, wd.CONSOLE)

    async def restore(self, snapshot_dir: Path, overrides: RestoreOverrides) -> FirecrackerVM:
        """Start a new Firecracker from ``snapshot_dir`` in the new ``overrides.workdir``;
        returns with the VM running. Any failure is a ``SnapshotError`` (the cause chained),
        with no process left behind. It is ``prestart`` then ``activate``: a pool of
        pre-started VMMs (``aenv.runtime.vmm_pool``) runs the first ahead of demand."""
        return await self.activate(await self.prestart(snapshot_dir, overrides))

    async def prestart(self, snapshot_dir: Path,
                       overrides: RestoreOverrides) -> FirecrackerPrestarted:
        """Everything of a restore before ``PUT /snapshot/load``: the working directory
        and drives, the jail, Firecracker spawned in ``overrides.netns`` with its API socket
        answering and its logger/serial set. ``activate`` sends the load; ``discard`` ends
        a VMM that will not be used. Any failure is a ``SnapshotError``, no process left."""
        vm_id, workdir = overrides.vm_id, overrides.workdir
        t = PhaseTimer()
        try:
            manifest = snapshots.read_manifest(snapshot_dir)
            if manifest.driver != fcsnap.DRIVER:
                raise SnapshotError(f"{snapshot_dir} was written by the {manifest.driver} "
                                    "driver, not by firecracker", vm_id=vm_id)
            unknown = set(overrides.drives) - {d.id for d in manifest.drives}
            if unknown:
                raise SnapshotError(f"overrides name drives the snapshot does not have: "
                                    f"{sorted(unknown)}", vm_id=vm_id)
            binary = self._binary_or_raise(vm_id)
            workdir.mkdir(parents=True)  # must be new: nothing of another VM may linger
            memory = await asyncio.to_thread(self._prepare_restore, manifest, snapshot_dir,
                                             overrides)
            machine = FirecrackerMachine.from_json(manifest.vm, snapshot_dir / snapshots.MANIFEST)
            overrides_net: list[tuple[str, str]] = []
            if machine.network and overrides.tap:
                # with_tap changes the host side only; the guest's iface_id stays
                overrides_net.append((machine.network.iface_id, overrides.tap))
                machine = machine.with_tap(overrides.tap)
            drive_names = [f"{d.id}.raw" for d in manifest.drives]
            launch = await asyncio.to_thread(
                self._launch, vm_id, workdir, overrides.netns, binary,
                vcpus=machine.vcpus, memory_mib=machine.memory_mib,
                limits=overrides.limits, largest_file=max(
                    (os.path.getsize(workdir / n) for n in drive_names), default=0))
            try:
                paths = await asyncio.to_thread(self._fill_restore_jail, launch, workdir,
                                                snapshot_dir, memory, manifest)
            except BaseException:
                await asyncio.to_thread(launch.jail.release)
                raise
            t.mark("files")
            load = fc.load_snapshot(*paths, track_dirty_pages=machine.track_dirty_pages,
                                    resume_vm=True, network_overrides=overrides_net)
            vm, _ = await self._start(vm_id, workdir, launch, machine, self._observability(),
                                      restored_from=snapshot_dir)
            t.mark("vmm")  # spawned, API answering, logger and serial set
        except BaseException as e:
            raise _restore_error(e, snapshot_dir, vm_id)  # noqa: B904 (chained by hand)
        return FirecrackerPrestarted(vm=vm, load=load, snapshot_dir=snapshot_dir,
                                     timings=dict(t.phases))

    async def activate(self, pre: FirecrackerPrestarted) -> FirecrackerVM:
        """``PUT /snapshot/load`` (with ``resume_vm``) into a pre-started Firecracker: the
        part of a restore that cannot be done ahead. On ``SnapshotError`` no process is
        left."""
        vm, t = pre.vm, PhaseTimer()
        try:
            await vm._call(pre.load, timeout=LOAD_TIMEOUT)
        except BaseException as e:
            error = await self._failed(vm, e, "loading the snapshot failed")
            if error is not e:
                error.__cause__ = e
            raise _restore_error(error, pre.snapshot_dir, vm.vm_id)  # noqa: B904
        t.mark("loaded")
        vm.boot_timings.update({**pre.timings, "activate": t.phases["loaded"],
                                "loaded": t.phases["loaded"]})
        total = sum(pre.timings.values()) + t.phases["loaded"]
        log.info("restored %s from %s in %.0f ms (files %.0f ms, load %.0f ms, pid %d)",
                 vm.vm_id, pre.snapshot_dir, total * 1000, pre.timings["files"] * 1000,
                 t.phases["loaded"] * 1000, vm.pid,
                 extra={"vm_id": vm.vm_id, "op": "restore", "duration": total})
        return vm

    async def discard(self, pre: FirecrackerPrestarted) -> None:
        """End a pre-started Firecracker that will not load its snapshot; its working
        directory stays (``workdir.remove``)."""
        await self._failed(pre.vm, VMError("discarded"), "discarded")

    @staticmethod
    def _prepare_restore(manifest: snapshots.Manifest, snapshot_dir: Path,
                         overrides: RestoreOverrides) -> Path:
        """Put every drive under its fixed name in the new working directory (an override,
        the shared read-only image, or a copy of the snapshot's own file, which must never be
        written: a reflink, else a sparse copy that costs what the disk holds), and return
        the memory file to load."""
        workdir = overrides.workdir
        if overrides.console_log is not None:
            overrides.console_log.parent.mkdir(parents=True, exist_ok=True)
            overrides.console_log.touch()
            (workdir / wd.CONSOLE).symlink_to(overrides.console_log.resolve())
        for d in manifest.drives:
            name = workdir / f"{d.id}.raw"
            name.unlink(missing_ok=True)
            if d.id in overrides.drives:
                name.symlink_to(overrides.drives[d.id].resolve())
            elif d.read_only and d.path is not None:
                name.symlink_to(d.path)
            else:
                assert d.file is not None
                fcsnap.clone(snapshot_dir / d.file, name)
        return fcsnap.memory_for_restore(manifest, workdir)

    @staticmethod
    def _fill_restore_jail(launch: _Launch, workdir: Path, snapshot_dir: Path, memory: Path,
                           manifest: snapshots.Manifest) -> tuple[str, str]:
        """The drives, console, state and memory a restore opens, as Firecracker names them
        (linked into the jail when it is jailed)."""
        if launch.jailed:
            for d in manifest.drives:
                name = f"{d.id}.raw"
                writable = not d.read_only
                fj.expose(workdir / name, launch.root / name, launch.jail, own=writable,
                          writable=writable)
            fj.expose_console(workdir, launch.root, launch.jail, wd.CONSOLE)
        own_memory = memory.resolve().parent == workdir.resolve()  # a merged stack
        return (launch.path(snapshot_dir / fcsnap.VMSTATE, fcsnap.VMSTATE, workdir, own=False),
                launch.path(memory, fcsnap.MEMORY, workdir, own=own_memory))

    async def _start(self, vm_id: str, workdir: Path, launch: _Launch,
                     machine: FirecrackerMachine, requests: list[fc.Request], *,
                     restored_from: Path | None,
                     last_timeout: float | None = None) -> tuple[FirecrackerVM, float]:
        """Spawn Firecracker (``launch``), wait for its socket, check its version and send
        ``requests``; on any failure no process is left, its jail is released and
        ``BootError`` says why."""
        accel = self.accel
        # Firecracker refuses an existing socket
        for stale in (launch.api_socket, workdir / wd.PIDFILE):
            stale.unlink(missing_ok=True)
        (workdir / wd.CONSOLE).touch()
        argv = launch.argv
        record: dict[str, Any] = {
            "vm_id": vm_id, "runtime": self.name, "accel": "kvm", "accel_reason": accel.reason,
            "argv": argv, "created_at": time.time(), "machine": machine.to_json(),
            "restored_from": str(restored_from) if restored_from else None,
            "memory_parent": str(restored_from) if restored_from else None,
            "jail_root": str(launch.root) if launch.jailed else None,
            "confinement": launch.jail.record() if launch.jailed else None,
        }
        _write_json(workdir / wd.MANIFEST, record)
        spawn = PhaseTimer()
        try:
            process = await asyncio.to_thread(VMMProcess.spawn, argv, workdir,
                                              workdir / wd.VMM_LOG)
        except OSError as e:
            await asyncio.to_thread(launch.jail.release)
            raise BootError(f"cannot start {argv[0]}: {e.strerror}", vm_id=vm_id) from e
        (workdir / wd.PIDFILE).write_text(f"{process.pid}\n")
        api = fc.FirecrackerAPI(launch.api_socket, vm_id=vm_id)
        vm = FirecrackerVM(vm_id=vm_id, workdir=workdir, process=process, api=api,
                           record=record, started_at=spawn.started, jail=launch.jail,
                           root=launch.root)
        try:
            version = await self._wait_for_api(vm, spawn.started + API_TIMEOUT)
            vm.boot_timings["api_ready"] = spawn.elapsed()
            if fc.parse_version(version) < fc.MIN_VERSION:
                raise BootError(f"Firecracker {version} is too old: aenv needs v1.14 or newer",
                                vm_id=vm_id)
            # the format of its vmstate
            vm.machine = dataclasses.replace(vm.machine, firecracker_version=version)
            record["machine"] = vm.machine.to_json()
            _write_json(workdir / wd.MANIFEST, record)
            for i, request in enumerate(requests):
                last = i == len(requests) - 1
                await vm._call(request, timeout=last_timeout if last else None)
        except BaseException as e:
            error = await self._failed(vm, e, "Firecracker did not start")
            if error is e:
                raise
            raise error from e
        return vm, spawn.elapsed()

    @staticmethod
    async def _wait_for_api(vm: FirecrackerVM, deadline: float) -> str:
        while True:
            if not vm.is_alive():
                status = await vm.wait()
                raise BootError(f"Firecracker exited with status {status} before its API "
                                "socket answered", vm_id=vm.vm_id)
            try:
                reply = await vm._api.send(fc.get_version(), timeout=1.0)
                return str(reply["firecracker_version"])
            except fc.APIConnectionError:
                if time.monotonic() > deadline:
                    raise BootError(f"Firecracker's API socket did not answer within "
                                    f"{API_TIMEOUT}s", vm_id=vm.vm_id) from None
                await asyncio.sleep(0.005)

    @staticmethod
    async def _failed(vm: FirecrackerVM, error: BaseException, what: str) -> BaseException:
        """Kill a VMM that failed to start; the exception to raise in place of ``error``
        (a ``BootError`` with both logs, or ``error`` itself for cancellation). The kill is
        synchronous so that even a cancelled start leaves no process."""
        vm._process.kill_now()
        await vm._api.aclose()
        await asyncio.to_thread(vm.jail.release)
        if not isinstance(error, Exception):
            return error
        if isinstance(error, BootError):
            result = error
        else:
            result = BootError(f"{what}: {error}", vm_id=vm.vm_id)
        result.console_tail = result.console_tail or wd.tail(vm.workdir / wd.CONSOLE)
        result.vmm_log_tail = result.vmm_log_tail or wd.tail(vm.workdir / wd.VMM_LOG)
        return result

    async def attach(self, workdir: Path) -> FirecrackerVM:
        """Find the live Firecracker of ``workdir`` (pidfile + cwd check) and reconnect."""
        try:
            record = json.loads((workdir / wd.MANIFEST).read_text())
            pid = int((workdir / wd.PIDFILE).read_text().strip())
        except (OSError, ValueError) as e:
            raise AttachError(f"no VMM recorded in {workdir}: {e}") from e
        vm_id = record.get("vm_id")
        if record.get("runtime") != self.name:
            raise AttachError(f"{workdir} belongs to the {record.get('runtime')} driver",
                              vm_id=vm_id)
        jail_root = Path(record["jail_root"]) if record.get("jail_root") else None
        try:
            process = VMMProcess.adopt(pid, workdir, jail_root=jail_root)
        except NotOurProcessError as e:
            raise AttachError(f"VMM of {vm_id}: {e}", vm_id=vm_id) from e
        root = jail_root or workdir
        api = fc.FirecrackerAPI(root / API_SOCKET, vm_id=vm_id)
        try:
            vm = FirecrackerVM(vm_id=vm_id, workdir=workdir, process=process, api=api,
                               record=record, started_at=time.monotonic(),
                               jail=Jail.from_record(vm_id, workdir, record.get("confinement")),
                               root=root)
        except MachineRecordError as e:
            process.abandon()
            raise AttachError(f"VMM of {vm_id}: {e}", vm_id=vm_id) from e
        try:
            state = await vm.status()
        except (ControlError, VMExitedError) as e:
            await api.aclose()
            process.abandon()
            raise AttachError(f"API of {vm_id} does not answer: {e}", vm_id=vm_id) from e
        log.info("attached %s (pid %d, %s)", vm_id, pid, state,
                 extra={"vm_id": vm_id, "op": "attach"})
        return vm


def _readable_manifest(directory: Path | None) -> snapshots.Manifest | None:
    """The manifest of a diff parent, or None when it is gone (then the snapshot is Full)."""
    if directory is None:
        return None
    try:
        return snapshots.read_manifest(directory)
    except snapshots.SnapshotFilesError:
        return None
