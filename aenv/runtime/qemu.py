"""The QEMU driver: ``qemu-system-x86_64 -M microvm`` driven over QMP (``qemu.qmp``, asyncio).

``boot`` prepares the working directory, starts QEMU there (inside the spec's netns, in its
own session and process group, stdin from /dev/null, stdout/stderr to ``vmm.log``), and
returns once QMP answers ``query-status`` with the VM running. The VMM is not tied to the
server: it survives a server exit, and ``attach`` finds it again through QEMU's own pidfile,
checking that the pid's cwd is that working directory before trusting it.

KVM or TCG is decided once per process by ``aenv.runtime.kvm``; the choice is recorded in
the VM handle (``accel``, ``accel_reason``), the manifest and the log.

Every QEMU runs confined (``aenv.runtime.confine``): its own uid, seccomp, a chroot into
its working directory and a cgroup sized from the VM, set up before it is spawned and
released once it has exited (``stop``); the manifest records it for ``attach``.

``VM.snapshot`` and ``restore`` follow ``aenv.runtime.qemu_snapshot`` (format, costs, and
why); this module only runs the processes: a restore is a boot with the snapshot's machine
shape that waits for an incoming migration, gets the memory diff written into its RAM, then
loads the device state from an inherited fd and starts the vCPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import EventListener, QMPClient, QMPError

from ..phase_timer import PhaseTimer
from . import confine, qemu_args, qemu_snapshot, write_tracking
from . import workdir as wd
from .base import (
    VM,
    AttachError,
    BootError,
    ControlError,
    RestoreOverrides,
    Runtime,
    SnapshotError,
    SnapshotInfo,
    VMError,
    VMExitedError,
    VMLimits,
    VMSpec,
)
from .confine import Confinement, Jail
from .kvm import AccelChoice, host_accel
from .qemu_snapshot import QemuMachine
from .vmm_process import NotOurProcessError, VMMProcess

log = logging.getLogger("aenv.runtime")

QMP_TIMEOUT = 10.0  # seconds from spawn until QMP must answer (TCG on a loaded 2-core host)
# TCG's translation cache per VM. QEMU's default, 1 GiB, is filled as the guest runs code it
# has not run before and never returned: booting to envd fills ~110 MiB, a little Python
# ~50 MiB more. When full it is flushed and refilled (retranslation costs time, not memory).
# A sandbox restored from base holds ~20-22 MiB of it while idle, whatever the size; one that
# ran a little Python, Node and git filled 256 MiB, and 128 with this size. Sizes compared
# (one sandbox each, commands.run of `true` x5, `python3 -c 'import json, asyncio, ...'`
# x3, `node -e` x2, a git commit x2, alternated on a shared host): 128 as fast as 256
# (true ~0.2 s, python 1.0-1.9 s, node warm 0.5-0.8 s each); 64 slowed the warm node run
# 2-5x; 32 and 24 everything about 2x; 16 everything about 3x (true 0.55 s).
TCG_TB_MIB = 128
_SYS_IO_URING_SETUP = 425
_UNIX_PATH_MAX = 107


@functools.cache
def io_uring_usable() -> bool:
    """Whether this kernel lets us create an io_uring (it may be disabled by sysctl/seccomp).

    Debian's QEMU links liburing, so the kernel is the only thing left to ask.
    """
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_SYS_IO_URING_SETUP, 1, params)
    if fd < 0:
        return False
    os.close(fd)
    return True


def qemu_binary() -> str | None:
    return shutil.which(qemu_args.QEMU_BINARY)


def qemu_version() -> str | None:
    """``7.2.22`` style version of the installed QEMU, or None when it is missing."""
    binary = qemu_binary()
    if binary is None:
        return None
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first.removeprefix("QEMU emulator version ").split(" ")[0] or None


def _unix_connect(path: Path) -> socket.socket:
    """Connect to a unix socket even when its absolute path is longer than sun_path allows,
    by going through ``/proc/self/fd/<dirfd>/`` (the kernel resolves that magic link)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if len(str(path)) <= _UNIX_PATH_MAX:
            sock.connect(str(path))
            return sock
        dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock.connect(f"/proc/self/fd/{dirfd}/{path.name}")
        finally:
            os.close(dirfd)
        return sock
    except BaseException:
        sock.close()
        raise


@dataclass
class Prestarted:
    """A restore's VMM up to its device state (``QemuRuntime.prestart``): spawned in its
    slot's netns with the snapshot's memory mapped and its drives open, QMP connected,
    waiting (``-incoming defer``) for ``QemuRuntime.activate``. ``state_fd``: the number
    of the device-state file's descriptor inside the VMM."""

    plan: qemu_snapshot.RestorePlan
    accel: AccelChoice
    jail: Jail
    process: VMMProcess
    qmp: QMPClient
    state_fd: int
    spawn: PhaseTimer  # made at the spawn: the milestones in ``timings`` are its readings
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def vm_id(self) -> str:
        return self.plan.spec.vm_id

    @property
    def workdir(self) -> Path:
        return self.plan.spec.workdir

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def _restore_error(e: BaseException, snapshot_dir: Path, spec: VMSpec) -> BaseException:
    """What a failed restore step raises: a ``SnapshotError`` with the VMM's log tail, or
    the error itself when it is no failure of the VMM (a cancellation)."""
    tail = wd.tail(spec.workdir / wd.VMM_LOG)
    if isinstance(e, SnapshotError):
        e.vmm_log_tail = e.vmm_log_tail or tail
        return e
    if isinstance(e, (BootError, QMPError, OSError, VMError)):
        err = SnapshotError(f"restore of {snapshot_dir} failed: {e}", vm_id=spec.vm_id,
                            vmm_log_tail=tail)
        err.__cause__ = e
        return err
    return e


class QemuVM(VM):
    """Handle on one QEMU process (``process``, a ``VMMProcess``) and its QMP connection.
    ``boot_timings`` holds host-clock seconds since spawn."""

    def __init__(
        self,
        *,
        vm_id: str,
        workdir: Path,
        accel: AccelChoice,
        process: VMMProcess,
        qmp: QMPClient,
        started_at: float,
        boot_timings: dict[str, float] | None = None,
        max_chain: int = qemu_snapshot.DEFAULT_MAX_CHAIN,
        jail: Jail | None = None,
    ) -> None:
        self.vm_id = vm_id
        self.workdir = workdir
        self.accel = accel.accel
        self.accel_reason = accel.reason
        self.console_log = workdir / wd.CONSOLE
        self.started_at = started_at  # time.monotonic() at spawn (at attach for attached VMs)
        self.boot_timings = boot_timings or {}
        self._process = process
        self._qmp = qmp
        self._max_chain = max_chain
        self.jail = jail or Jail(vm_id, workdir, released=True)

    @property
    def pid(self) -> int:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def send_fd(self, fd: int) -> None:
        """Hand ``fd`` to QEMU over the QMP socket (SCM_RIGHTS), for the next ``add-fd`` or
        ``getfd``. qemu.qmp's own ``send_fd_scm`` reaches into asyncio's socket wrapper,
        which uvloop (the server's event loop) does not have; sending on a duplicate of the
        socket's descriptor works under both (the library keeps no public handle on it)."""
        if not self.is_alive():
            raise VMExitedError(f"VMM of {self.vm_id} has exited", vm_id=self.vm_id)
        sock = self._qmp._writer.transport.get_extra_info("socket")  # type: ignore[union-attr]
        with socket.socket(fileno=os.dup(sock.fileno())) as raw:
            socket.send_fds(raw, [b" "], [fd])

    async def execute(self, command: str,
                      arguments: Mapping[str, object] | None = None) -> dict[str, Any]:
        """Run one QMP command; its return object (``{}`` for a command that returns
        nothing; a command returning something else, e.g. a list, gets it under
        ``"return"``). Raises ``VMExitedError`` when the VMM is gone (before or during the
        command) and ``ControlError`` when QEMU refuses or fails it."""
        if not self.is_alive():
            raise VMExitedError(f"VMM of {self.vm_id} has exited", vm_id=self.vm_id)
        try:
            reply = await self._qmp.execute(command, dict(arguments) if arguments else None)
        except QMPError as e:
            if not self.is_alive():
                raise VMExitedError(f"VMM of {self.vm_id} exited during {command}",
                                    vm_id=self.vm_id) from e
            raise ControlError(f"QMP {command} failed for {self.vm_id}: {e}",
                               vm_id=self.vm_id) from e
        return reply if isinstance(reply, dict) else {"return": reply}

    async def status(self) -> str:
        """QEMU's run state: ``running``, ``paused``, ``shutdown``..."""
        reply = await self.execute("query-status")
        return str(reply["status"])

    async def pause(self) -> None:
        t = PhaseTimer()
        await self.execute("stop")
        log.info("paused", extra={"vm_id": self.vm_id, "op": "pause",
                                  "duration": t.elapsed()})

    async def resume(self) -> None:
        t = PhaseTimer()
        await self.execute("cont")
        log.info("resumed", extra={"vm_id": self.vm_id, "op": "resume",
                                   "duration": t.elapsed()})

    async def snapshot(self, directory: Path, *, stop: bool = False,
                       incremental: bool = True) -> SnapshotInfo:
        return await qemu_snapshot.capture(self, directory, stop=stop, incremental=incremental,
                                           max_chain=self._max_chain)

    async def pause_deferred(self, directory: Path, note: dict[str, Any] | None = None
                             ) -> tuple[SnapshotInfo, qemu_snapshot.QemuDeferredMemory | None]:
        """A restored VM's pause answers once its device state and drives are committed;
        its memory is written by the returned ``QemuDeferredMemory``
        (``qemu_snapshot.capture_deferred``). ``note``: kept in the marker for a restart."""
        return await qemu_snapshot.capture_deferred(self, directory, note=note or {},
                                                    max_chain=self._max_chain)

    def deferred_memory(self, directory: Path) -> qemu_snapshot.QemuDeferredMemory:
        return qemu_snapshot.QemuDeferredMemory(self, directory, self._max_chain)

    def active_drive(self, drive_id: str) -> Path:
        """A running snapshot switches a qcow2 drive onto a new overlay; the lineage
        records which file is the top now."""
        lineage = qemu_snapshot.Lineage.load(self.workdir,
                                             qemu_snapshot.read_machine(self.workdir))
        try:
            return (self.workdir / lineage.tops[drive_id]).resolve()
        except KeyError:
            raise VMError(f"no writable drive {drive_id}", vm_id=self.vm_id) from None

    async def stop(self, timeout: float = 5.0) -> None:
        """QMP ``quit``; if the VMM is still there after ``timeout``, SIGTERM its process
        group, then SIGKILL it (each wait bounded by ``timeout``). Leaves the working
        directory (see ``workdir.remove``)."""
        t = PhaseTimer()
        if self.is_alive():
            try:
                await asyncio.wait_for(self._qmp.execute("quit"), timeout)
            except (TimeoutError, QMPError, EOFError, OSError):
                pass  # the VMM may close the socket before answering; the wait below decides
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                self._process.signal_group(sig)
            try:
                await asyncio.wait_for(self.wait(), timeout)
                break
            except TimeoutError:
                continue
        await self.detach()
        if not self.is_alive():
            self._process.close()
            await asyncio.to_thread(self.jail.release)
        log.info("stopped", extra={"vm_id": self.vm_id, "op": "stop",
                                   "duration": t.elapsed()})

    async def wait(self) -> int | None:
        return await self._process.wait()

    async def detach(self) -> None:
        """Drop the QMP connection but leave the VMM running (server shutdown): QEMU serves
        one QMP client at a time, so the next server's ``attach`` needs it free."""
        try:
            await self._qmp.disconnect()
        except (QMPError, EOFError, OSError):
            pass


class QemuRuntime(Runtime):
    name = "qemu"
    # The VMM holds the tap from its start (``prestart``): packets sent to the guest before
    # its vCPUs run wait in QEMU's queue and reach it once they do (an /init sent while
    # the state loads; ``NodeMachines._restore``).
    nic_open_at_prestart = True

    def __init__(self, *, accel: AccelChoice | None = None, binary: str | None = None,
                 max_chain: int = qemu_snapshot.DEFAULT_MAX_CHAIN,
                 confinement: Confinement | None = None,
                 tcg_tb_mib: int | None = TCG_TB_MIB,
                 track_writes: Path | None = None) -> None:
        """``max_chain``: how many snapshot layers a VM's memory and drives may stack up
        before a snapshot compacts them (see ``qemu_snapshot``). ``confinement``: how VMMs
        are confined (default ``Confinement()``: everything the host allows).
        ``tcg_tb_mib``: TCG's translation cache per VM (None: QEMU's default, 1 GiB).
        ``track_writes``: where ``write_tracking``'s library is built, so that a restored
        VM's snapshots copy only what it wrote since the last one (None: not tracked)."""
        if max_chain < 1:
            raise ValueError("max_chain must be >= 1")
        self._accel = accel
        self._binary = binary
        self._max_chain = max_chain
        self.confinement = confinement if confinement is not None else Confinement()
        self.tcg_tb_mib = tcg_tb_mib
        self.track_writes = track_writes

    @property
    def accel(self) -> AccelChoice:
        return self._accel or host_accel()

    async def boot(self, spec: VMSpec) -> QemuVM:
        binary = self._binary or qemu_binary()
        if binary is None:
            raise BootError(f"{qemu_args.QEMU_BINARY} is not installed", vm_id=spec.vm_id)
        accel = self.accel
        wd.prepare(spec)
        jail = await self._jail(spec.vm_id, spec.workdir, spec.vcpus, spec.memory_mib, accel,
                                spec.limits, BootError)
        try:
            argv = await self._argv(spec, accel, binary, jail=jail)
            self._write_record(spec, accel, argv, QemuMachine.of(spec, accel.accel), jail)
            vmm_log = spec.workdir / wd.VMM_LOG
            spawn = PhaseTimer()  # boot_timings are seconds since the spawn
            process = await asyncio.to_thread(VMMProcess.spawn, jail.wrap(argv), spec.workdir,
                                              vmm_log)
        except BaseException:
            await asyncio.to_thread(jail.release)
            raise
        try:
            qmp = await self._connect_qmp(spec, process)
            t_qmp = spawn.elapsed()
            if accel.accel == "tcg":  # started paused (qemu_args.TCG_BOOT_HMP)
                for line in qemu_args.TCG_BOOT_HMP:
                    await qmp.execute("human-monitor-command", {"command-line": line})
                await qmp.execute("cont")
            status = (await qmp.execute("query-status"))["status"]  # type: ignore[index]
            if status != "running":
                raise BootError(f"VMM came up {status}, not running", vm_id=spec.vm_id)
        except BaseException as e:
            process.kill_now()
            await asyncio.to_thread(jail.release)
            if isinstance(e, BootError):
                e.console_tail = e.console_tail or wd.tail(spec.workdir / wd.CONSOLE)
                e.vmm_log_tail = e.vmm_log_tail or wd.tail(vmm_log)
            raise
        vm = QemuVM(vm_id=spec.vm_id, workdir=spec.workdir, accel=accel, process=process,
                    qmp=qmp, started_at=spawn.started, boot_timings={"qmp_ready": t_qmp},
                    max_chain=self._max_chain, jail=jail)
        log.info(
            "booted %s on %s in %.0f ms (pid %d)", spec.vm_id, accel.accel, t_qmp * 1000,
            process.pid,
            extra={"vm_id": spec.vm_id, "op": "boot", "phase": "qmp_ready", "duration": t_qmp,
                   "accel": accel.accel},
        )
        return vm

    def _write_record(self, spec: VMSpec, accel: AccelChoice, argv: list[str],
                      machine: QemuMachine, jail: Jail, *,
                      restored_from: Path | None = None) -> None:
        """The working directory's ``vm.json``, before the VMM starts: what ``attach`` reads
        (id, accelerator, confinement), ``workdir.remove`` (confinement) and every snapshot
        of the VM (the machine record)."""
        record: dict[str, Any] = {
            "vm_id": spec.vm_id, "runtime": self.name, "accel": accel.accel,
            "accel_reason": accel.reason, "argv": argv, "created_at": time.time(),
            "machine": machine.to_json(),
        }
        if restored_from is not None:
            record["restored_from"] = str(restored_from)
        record["confinement"] = jail.record()
        (spec.workdir / wd.MANIFEST).write_text(json.dumps(record, indent=1))

    async def _argv(self, spec: VMSpec, accel: AccelChoice, binary: str, *, jail: Jail,
                    restore: bool = False) -> list[str]:
        """The VMM's command line, built in a thread: the first one under TCG measures the
        host's TSC rate (``aenv.runtime.tsc``, ~0.1 s), which must not stall the loop."""
        return await asyncio.to_thread(
            qemu_args.build_argv, spec, accel.accel, binary=binary,
            aio="io_uring" if io_uring_usable() else "threads", restore=restore,
            tcg_tb_mib=self.tcg_tb_mib, confine=jail.qemu_args())

    async def _jail(self, vm_id: str, workdir: Path, vcpus: int, memory_mib: int,
                    accel: AccelChoice, limits: VMLimits | None,
                    error: type[VMError]) -> Jail:
        """The VM's confinement (uid, cgroup); a failure is ``error``."""
        tb = (self.tcg_tb_mib or 1024) if accel.accel == "tcg" else None
        try:
            return await asyncio.to_thread(
                confine.prepare, self.confinement, vm_id, workdir, vcpus=vcpus,
                memory_mib=memory_mib, tcg_tb_mib=tb, overrides=limits)
        except (confine.ConfinementError, OSError) as e:
            raise error(f"cannot confine the VMM of {vm_id}: {e}", vm_id=vm_id) from e

    def cleanup_leftovers(self, vms_dir: Path, keep: set[str]) -> dict[str, list[str]]:
        return confine.cleanup_leftovers(self.confinement, vms_dir, keep)

    def prepare_compaction(self, directory: Path) -> qemu_snapshot.QemuCompaction | None:
        return qemu_snapshot.prepare_compaction(directory, self._max_chain)

    async def _connect_qmp(self, spec: VMSpec, process: VMMProcess) -> QMPClient:
        sock_path = spec.workdir / wd.QMP_SOCKET
        deadline = time.monotonic() + QMP_TIMEOUT
        while True:
            if not process.is_alive():
                raise BootError(f"VMM exited with status {process.returncode} before QMP was up",
                                vm_id=spec.vm_id)
            try:
                sock = _unix_connect(sock_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise BootError(f"QMP did not come up within {QMP_TIMEOUT}s",
                                    vm_id=spec.vm_id) from None
                await asyncio.sleep(0.005)
        qmp = QMPClient(spec.vm_id)
        try:
            await asyncio.wait_for(qmp.connect(sock), max(0.1, deadline - time.monotonic()))
        except (TimeoutError, QMPError, OSError) as e:
            sock.close()
            raise BootError(f"QMP handshake failed: {e}", vm_id=spec.vm_id) from e
        return qmp

    async def restore(self, snapshot_dir: Path, overrides: RestoreOverrides) -> QemuVM:
        """Spawn QEMU with the snapshot's machine shape waiting for an incoming migration,
        write the memory diff into its RAM, load the device state from an inherited fd
        (``migrate-incoming fd:N``); the vCPUs start once it is loaded (autostart).
        ``boot_timings``: ``qmp_ready``, ``state_loaded``, ``memory_applied``, ``running``
        (seconds after spawn) and ``prepare`` (seconds before it: disks, links). It is
        ``prestart`` then ``activate``: a pool of pre-started VMMs
        (``aenv.runtime.vmm_pool``) runs the first ahead of demand."""
        return await self.activate(await self.prestart(snapshot_dir, overrides))

    async def prestart(self, snapshot_dir: Path, overrides: RestoreOverrides) -> Prestarted:
        """Everything of a restore up to the device state: the working directory, the
        confinement, QEMU spawned in ``overrides.netns`` with the snapshot's base memory
        mapped copy-on-write and its drives open, the diff layers written into its RAM,
        QMP connected, autostart set. The VMM then waits (``-incoming defer``) for
        ``activate``; ``discard`` ends one that is not wanted. On ``SnapshotError`` no VMM
        is left; the working directory is."""
        binary = self._binary or qemu_binary()
        if binary is None:
            raise SnapshotError(f"{qemu_args.QEMU_BINARY} is not installed",
                                vm_id=overrides.vm_id)
        prep = PhaseTimer()
        plan = await asyncio.to_thread(qemu_snapshot.prepare_restore, snapshot_dir, overrides)
        host = self.accel
        if plan.accel != host.accel and plan.accel == "kvm":
            raise SnapshotError(f"{snapshot_dir} was taken under KVM, which this host lacks "
                                f"({host.reason})", vm_id=overrides.vm_id)
        accel = AccelChoice(plan.accel, host.reason if plan.accel == host.accel
                            else f"restored from a {plan.accel} snapshot")
        spec = plan.spec
        jail = await self._jail(spec.vm_id, spec.workdir, spec.vcpus, spec.memory_mib, accel,
                                overrides.limits, SnapshotError)
        try:
            fd = os.open(plan.device_state, os.O_RDONLY | os.O_CLOEXEC)
            try:
                argv = await self._argv(spec, accel, binary, jail=jail, restore=True)
                self._write_record(spec, accel, argv, plan.machine, jail,
                                   restored_from=snapshot_dir)
                prep.mark("prepare")
                spawn = PhaseTimer()  # boot_timings are seconds since the spawn
                lib = (await asyncio.to_thread(write_tracking.library, self.track_writes)
                       if self.track_writes is not None else None)
                env = (write_tracking.launch_env(lib, spec.workdir / wd.BASE_MEMORY)
                       if lib is not None else None)
                process = await asyncio.to_thread(VMMProcess.spawn, argv, spec.workdir,
                                                  spec.workdir / wd.VMM_LOG, (fd,), env)
            finally:
                os.close(fd)
        except BaseException:
            await asyncio.to_thread(jail.release)
            raise
        timings = dict(prep.phases)
        # Into its cgroup while it starts up (-S: no vCPU runs, no guest memory is written
        # before the join has finished; see confine).
        joined = asyncio.ensure_future(asyncio.to_thread(jail.join, process.pid))
        try:
            qmp = await self._connect_qmp(spec, process)
            timings["qmp_ready"] = spawn.elapsed()
            await joined
            await asyncio.to_thread(qemu_snapshot.apply_memory, process.pid, plan,
                                    track=env is not None)
            timings["memory_applied"] = spawn.elapsed()
            # While a migration is awaited, ``cont`` only sets QEMU's autostart: the vCPUs
            # then start as soon as the device state is loaded, with no round trip between.
            await qmp.execute("cont")
        except BaseException as e:
            process.kill_now()
            with contextlib.suppress(BaseException):
                await joined  # finished or failed by now; its error is not this one
            await asyncio.to_thread(jail.release)
            raise _restore_error(e, snapshot_dir, spec)  # noqa: B904 (chained by hand)
        return Prestarted(plan=plan, accel=accel, jail=jail, process=process, qmp=qmp,
                          state_fd=fd, spawn=spawn, timings=timings)

    async def activate(self, pre: Prestarted) -> QemuVM:
        """Load the device state into a pre-started VMM and start its vCPUs: the part of a
        restore that cannot be done ahead. ``boot_timings`` as ``restore``'s, plus
        ``activate`` (seconds this call took). On ``SnapshotError`` the VMM is gone; the
        working directory is left."""
        spec, qmp, process = pre.plan.spec, pre.qmp, pre.process
        timings = dict(pre.timings)
        act = PhaseTimer()
        try:
            if not process.is_alive():
                raise SnapshotError(f"VMM exited with status {process.returncode} while "
                                    "waiting for its state", vm_id=spec.vm_id)
            # The vCPUs start (autostart) once the state is loaded: QEMU says so with a
            # RESUME event, which is awaited rather than polled for.
            resumed = EventListener(("RESUME",))
            with qmp.listen(resumed):
                await qmp.execute("migrate-incoming", {"uri": f"fd:{pre.state_fd}"})
                deadline = time.monotonic() + QMP_TIMEOUT
                while True:
                    try:
                        await asyncio.wait_for(resumed.get(), 0.05)
                        break
                    except TimeoutError:
                        if not process.is_alive():
                            raise SnapshotError("VMM exited while loading its state",
                                                vm_id=spec.vm_id) from None
                        if time.monotonic() > deadline:
                            raise SnapshotError(f"device state did not load in "
                                                f"{QMP_TIMEOUT}s", vm_id=spec.vm_id) from None
            timings["activate"] = act.elapsed()
            timings["state_loaded"] = timings["running"] = pre.spawn.elapsed()
        except BaseException as e:
            await self.discard(pre)
            raise _restore_error(e, pre.plan.snapshot_dir, spec)  # noqa: B904
        vm = QemuVM(vm_id=spec.vm_id, workdir=spec.workdir, accel=pre.accel, process=process,
                    qmp=qmp, started_at=pre.spawn.started, boot_timings=timings,
                    max_chain=self._max_chain, jail=pre.jail)
        log.info(
            "restored %s from %s in %.0f ms (memory %.0f, loaded %.0f, activated in %.0f; "
            "pid %d)", spec.vm_id, pre.plan.snapshot_dir, timings["running"] * 1000,
            (timings["memory_applied"] - timings["qmp_ready"]) * 1000,
            timings["state_loaded"] * 1000, timings["activate"] * 1000, process.pid,
            extra={"vm_id": spec.vm_id, "op": "restore", "phase": "running",
                   "duration": timings["running"], "accel": pre.accel.accel},
        )
        return vm

    async def discard(self, pre: Prestarted) -> None:
        """End a pre-started VMM that will not be activated and release its confinement;
        the working directory stays (``workdir.remove``)."""
        with contextlib.suppress(QMPError, EOFError, OSError):
            await pre.qmp.disconnect()
        await asyncio.to_thread(pre.process.kill_now)
        await asyncio.to_thread(pre.jail.release)

    async def attach(self, workdir: Path) -> QemuVM:
        """Find the live QEMU of ``workdir`` by its pidfile and take over its QMP socket."""
        try:
            manifest = json.loads((workdir / wd.MANIFEST).read_text())
            pid = int((workdir / wd.PIDFILE).read_text().strip())
        except (OSError, ValueError) as e:
            raise AttachError(f"no VMM recorded in {workdir}: {e}") from e
        vm_id = manifest["vm_id"]
        try:
            process = VMMProcess.adopt(pid, workdir)  # pins the pid, then checks its cwd
        except NotOurProcessError as e:
            raise AttachError(f"VMM of {vm_id}: {e}", vm_id=vm_id) from e
        try:
            qmp = await self._reconnect_qmp(vm_id, workdir)
        except BaseException:
            process.abandon()
            raise
        accel = AccelChoice(manifest["accel"], manifest["accel_reason"])
        log.info("attached %s (pid %d)", vm_id, pid, extra={"vm_id": vm_id, "op": "attach"})
        jail = Jail.from_record(vm_id, workdir, manifest.get("confinement"))
        return QemuVM(vm_id=vm_id, workdir=workdir, accel=accel, process=process, qmp=qmp,
                      started_at=time.monotonic(), max_chain=self._max_chain, jail=jail)

    @staticmethod
    async def _reconnect_qmp(vm_id: str, workdir: Path) -> QMPClient:
        """A new QMP connection to a running VMM (``attach``)."""
        qmp = QMPClient(vm_id)
        try:
            sock = _unix_connect(workdir / wd.QMP_SOCKET)
            try:
                await asyncio.wait_for(qmp.connect(sock), 5)
            except BaseException:
                sock.close()
                raise
        except (TimeoutError, QMPError, OSError) as e:
            # QEMU serves one QMP client at a time: a live handle elsewhere times this out.
            raise AttachError(f"QMP of {vm_id} does not answer ({type(e).__name__}: {e}); "
                              "is another client still connected?", vm_id=vm_id) from e
        return qmp
