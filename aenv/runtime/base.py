"""The VMM-neutral runtime interface: a ``VMSpec`` in, a running ``VM`` handle out.

Shaped after Firecracker's model so every driver fits it: drives are host paths, the network
device is a tap name inside the sandbox's network namespace, a snapshot is a VM-state file plus
a memory file, and restoring one takes the snapshot directory plus overrides (new working
directory, tap, drive paths). A driver owns one VMM process per VM; policy (when to pause, how
many forks) belongs to the orchestrator, not here.

Contract for every driver:
- ``Runtime.boot`` returns once the VMM process runs and its control channel answers; it does
  not wait for the guest (see ``aenv.runtime.ready.wait_for_envd``).
- The VMM runs with its working directory = ``VMSpec.workdir`` and sees only fixed relative
  names there (see ``aenv.runtime.workdir``), so no VM state embeds a sandbox-specific path.
- The VMM runs in its own process group and survives the server (``VM.detach`` lets go of
  it at a shutdown); ``Runtime.attach`` finds it again from the working directory alone.
- The VMM runs confined (``aenv.runtime.confine``): its own unprivileged uid, seccomp, a
  chroot into its working directory, a cgroup with limits from the VM's size
  (``VMLimits``); ``VM.stop`` releases them, and so does ``workdir.remove`` for a VMM that
  died unseen. ``Runtime.cleanup_leftovers`` removes what a crashed server left.
- Operations a driver cannot do yet raise ``NotSupportedError`` (a ``NotImplementedError``).

Snapshots (``VM.snapshot``, ``Runtime.restore``) — the contract the orchestrator builds pause,
resume, fork and persistent snapshots on (every driver captures through the one recipe of
``aenv.runtime.snapshot_recipe``, which also makes its errors ``SnapshotError``):
- A snapshot is a directory (layout: ``aenv.storage.snapshots``): device state, a memory
  layer, a layer per writable drive, and a manifest. It may reference files of the snapshot
  the VM was restored from (its parent); the chain is bounded by the driver, which
  compacts it when it would grow deeper than its limit — within the capture, or after it
  (``Runtime.prepare_compaction``, run in the background by ``aenv.runtime.compaction``).
- ``VM.snapshot(dir, stop=True)`` is *pause*: the VMM is gone afterwards and the VM lives on
  only in ``dir`` (CPU and RAM released; the caller then removes the working directory and
  the slot). ``stop=False`` is a *persistent snapshot / fork capture*: the vCPUs are frozen
  only for the capture, and the VM runs on (``SnapshotInfo.freeze_s`` vs ``total_s``).
- ``Runtime.restore(dir, overrides)`` starts a new VMM in a new working directory, tap and
  netns, each drive on its own copy-on-write layer over the snapshot's, memory mapped
  copy-on-write (so restores of one snapshot share the host page cache). It returns with
  the vCPUs running. Any number of restores of one snapshot may run at once.
- The guest's clock and RNG are as they were at capture; the caller fixes both (envd
  ``/init`` with a timestamp and entropy). TCP connections from before are dead.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..network.guest_link import GUEST_MAC

DriveFormat = Literal["raw", "qcow2"]
Accel = Literal["kvm", "tcg"]


# -- errors -----------------------------------------------------------------------------------


class VMError(Exception):
    """Base of every runtime error; ``vm_id`` says which VM (None before one exists)."""

    def __init__(self, message: str, *, vm_id: str | None = None) -> None:
        super().__init__(message)
        self.vm_id = vm_id


class BootError(VMError):
    """The VMM did not come up, or the guest died while booting.

    ``console_tail`` holds the last lines of the guest serial console and ``vmm_log_tail``
    the VMM's own stderr, so the caller can show why without opening files.
    """

    def __init__(
        self,
        message: str,
        *,
        vm_id: str | None = None,
        console_tail: str = "",
        vmm_log_tail: str = "",
    ) -> None:
        super().__init__(message, vm_id=vm_id)
        self.console_tail = console_tail
        self.vmm_log_tail = vmm_log_tail

    def __str__(self) -> str:
        parts = [super().__str__()]
        if self.vmm_log_tail:
            parts.append("--- vmm log ---\n" + self.vmm_log_tail)
        if self.console_tail:
            parts.append("--- console ---\n" + self.console_tail)
        return "\n".join(parts)


class VMExitedError(VMError):
    """The VMM process is gone; the operation cannot be carried out."""


class ControlError(VMError):
    """The VMM refused or failed a control command (QMP error, API error)."""


class AttachError(VMError):
    """No live VMM of ours belongs to that working directory."""


class NotSupportedError(VMError, NotImplementedError):
    """This driver does not implement the operation (yet); nothing was changed."""


class SnapshotError(VMError):
    """A snapshot could not be taken or restored. When taking one fails, the VM is as it
    was (running or paused) unless ``vm_lost`` says the VMM was already stopped."""

    def __init__(self, message: str, *, vm_id: str | None = None, vm_lost: bool = False,
                 vmm_log_tail: str = "") -> None:
        super().__init__(message, vm_id=vm_id)
        self.vm_lost = vm_lost
        self.vmm_log_tail = vmm_log_tail

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n--- vmm log ---\n{self.vmm_log_tail}" if self.vmm_log_tail else base


class MachineRecordError(SnapshotError):
    """A persisted machine record (a working directory's ``vm.json``, a snapshot manifest's
    ``vm``) is of a version or shape this aenv does not read
    (``aenv.runtime.machine_record``); nothing was started or changed."""


class MemoryWriteAbandoned(SnapshotError):
    """``DeferredMemory.write`` did nothing more, or stopped part-way: a resume took the
    frozen VMM back (``DeferredMemory.abandon``). The VMM, its drives and its working
    directory are the resumed VM's; the snapshot is abandoned."""


class UnknownRuntimeError(VMError):
    """``get_runtime`` was asked for a driver that does not exist."""


# -- specification --------------------------------------------------------------------------


@dataclass(frozen=True)
class Drive:
    """A block device backed by a host file. The first drive of a spec is the root fs."""

    id: str
    path: Path
    read_only: bool = False
    format: DriveFormat = "raw"

    def __post_init__(self) -> None:
        if not self.id.isidentifier():
            raise ValueError(f"drive id must be an identifier: {self.id!r}")
        if self.format not in ("raw", "qcow2"):
            raise ValueError(f"unknown drive format {self.format!r}")


@dataclass(frozen=True)
class VMLimits:
    """What one VM's VMM may use, enforced by its cgroup (``aenv.runtime.confine``). A field
    left None is derived from the VM's size (``confine.limits_for``: guest RAM plus the
    VMM's overhead, the vCPUs plus a quarter CPU, tasks, io weight by vCPUs).
    ``memory_bytes``: ``memory.max``; ``cpus``: CPU time in CPUs (``cpu.max``), 0 for no
    cap; ``pids``: ``pids.max``; ``io_weight``: 1..10000 (``io.weight``)."""

    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    io_weight: int | None = None


@dataclass(frozen=True)
class VMSpec:
    """Everything a driver needs to boot one VM.

    ``drives`` lists the root filesystem first (the guest sees it as /dev/vda). ``mac`` is the
    fixed guest identity's (``aenv.network.guest_link``), the same in every sandbox. ``tap`` names
    a tap device that exists in ``netns`` (or in the caller's namespace when ``netns`` is
    None); None means no network device. ``memory_file``, when set, is a host file that backs
    guest RAM and is shared with the VMM (so the snapshot code can later map it
    copy-on-write); None means anonymous memory. A driver whose VMM cannot back RAM by a file
    at boot raises ``NotSupportedError`` for it. ``console_log`` defaults to ``console.log``
    in the working directory. ``limits`` None: derived from ``vcpus`` and ``memory_mib``.
    """

    vm_id: str
    workdir: Path
    kernel: Path
    boot_args: str
    drives: tuple[Drive, ...] = ()
    initrd: Path | None = None
    vcpus: int = 1
    memory_mib: int = 256
    tap: str | None = None
    netns: str | None = None
    mac: str = GUEST_MAC
    memory_file: Path | None = None
    console_log: Path | None = None
    limits: VMLimits | None = None

    def __post_init__(self) -> None:
        if self.vcpus < 1 or self.memory_mib < 16:
            raise ValueError("a VM needs at least 1 vCPU and 16 MiB")
        ids = [d.id for d in self.drives]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate drive ids: {ids}")


@dataclass(frozen=True)
class RestoreOverrides:
    """What differs between the snapshotted VM and the restored one (Firecracker's model).

    ``workdir`` must not exist yet. ``drives`` maps a drive id to a disk the caller made
    itself (it must show the snapshot's contents of that drive, e.g. an overlay over the
    snapshot's file); other writable drives get a new layer in ``workdir``. ``tap`` None
    keeps the tap name the snapshot had (every slot's tap has the same name); ``netns``
    is the new slot's namespace. ``limits`` as in ``VMSpec`` (None: from the snapshot's
    machine size).
    """

    vm_id: str
    workdir: Path
    drives: dict[str, Path] = field(default_factory=dict)  # drive id -> new host path
    tap: str | None = None
    netns: str | None = None
    console_log: Path | None = None
    limits: VMLimits | None = None


@dataclass(frozen=True)
class SnapshotInfo:
    """What one ``VM.snapshot`` did (seconds; bytes).

    ``freeze_s``: vCPUs stopped until they ran again (``stop=False``) or until the VMM was
    gone (``stop=True``). ``memory_bytes``: memory this snapshot wrote itself (a diff, or a
    full image when it had to); ``memory_layers``: depth of the memory stack a restore
    applies (1 = one full image). ``compacted``: the chain was cut back to its base.
    ``phases``: where the time went, driver-specific names.
    """

    directory: Path
    parent: Path | None
    freeze_s: float
    total_s: float
    memory_bytes: int
    memory_layers: int
    disk_bytes: int
    compacted: bool
    phases: dict[str, float] = field(default_factory=dict)


class Compaction(abc.ABC):
    """A snapshot's chains cut back, made off the capture (``Runtime.prepare_compaction``)
    and put in place in two steps, each of which leaves the snapshot whole if the server
    dies right after it (``aenv.runtime.compaction`` runs them):

    - ``install``: the flattened files replace the snapshot's own (each an atomic rename
      of a file already fsynced); from here new readers open the short chain, while the
      manifest still names the old one, so nothing it depended on can be collected yet
      (a merged memory stack: the manifest names the new stack and keeps the old layers
      as ``retired``). False when the snapshot went meanwhile (nothing was changed then).
    - ``release``: the manifest stops naming the files the flattened ones no longer read,
      so garbage collection may delete them. Run it a while after ``install``: a reader
      that opened the old file just before the rename may still be opening its chain.
    - ``discard``: drop what was made when it will not be installed.
    """

    directory: Path

    @abc.abstractmethod
    def install(self) -> bool: ...

    @abc.abstractmethod
    def release(self) -> None: ...

    @abc.abstractmethod
    def discard(self) -> None: ...


# -- handles --------------------------------------------------------------------------------


class DeferredMemory(abc.ABC):
    """The rest of a pause that answered before guest memory was written
    (``VM.pause_deferred``): the snapshot ``directory`` is committed with its device state,
    drives and a ``memory.pending`` marker (``aenv.storage.snapshots.memory_pending``), and
    the VMM waits, frozen, for ``write``."""

    directory: Path
    vm: VM  # the frozen VM whose memory is written

    @abc.abstractmethod
    async def write(self) -> dict[str, float]:
        """Copy the memory layer out of the frozen VMM into ``directory``, make it durable,
        finish the manifest, remove the marker (in that order: a crash at any point leaves
        the marker until the layer is whole), then end the VMM. Returns seconds per phase.
        Raises ``SnapshotError`` (the marker stays; the VMM is ended all the same), or
        ``MemoryWriteAbandoned`` after ``abandon`` (the VMM is left alone)."""

    async def abandon(self) -> bool:
        """Take the frozen VM back for a resume in place, if the memory is not written
        yet: ``write`` stops (waited for) or never starts, the marker becomes
        ``memory.abandoned`` (durably: a restart then takes the VMM for a running
        sandbox), and the VM's drives are its own again, so ``VM.resume`` may continue
        it. False when too late (the write is committing; it finishes as usual) or
        unsupported (the default)."""
        return False


class VM(abc.ABC):
    """A running (or paused) VM owned by one VMM process.

    ``started_at`` is ``time.monotonic()`` when the VMM was spawned (or attached to), and
    ``boot_timings`` holds seconds after that for the steps the driver saw (``qmp_ready``).
    """

    vm_id: str
    workdir: Path
    accel: Accel
    accel_reason: str
    console_log: Path
    started_at: float
    boot_timings: dict[str, float]

    @property
    @abc.abstractmethod
    def pid(self) -> int:
        """Host pid of the VMM process."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Whether the VMM process still runs."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop the vCPUs; guest memory and devices stay as they are."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Run the vCPUs again after ``pause``."""

    @abc.abstractmethod
    async def snapshot(self, directory: Path, *, stop: bool = False,
                       incremental: bool = True) -> SnapshotInfo:
        """Capture the VM into the new directory ``directory``.

        The vCPUs are stopped for the capture. With ``stop`` the VMM then ends (pause to
        disk) and the VM's writable drive files move into the snapshot; otherwise the VM
        continues as it was before the call (running, or paused if the caller had paused
        it), on new drive layers. ``incremental=False`` writes a snapshot that depends on
        no other snapshot (full memory image, drives flattened onto their base images),
        at a cost that grows with the VM's size; by default only what changed since the
        snapshot the VM came from is written. Raises ``SnapshotError``; the directory is
        not created then.
        """

    async def pause_deferred(self, directory: Path, note: dict[str, Any] | None = None
                             ) -> tuple[SnapshotInfo, DeferredMemory | None]:
        """A pause (``snapshot(stop=True)``) that may answer before guest memory is written:
        with a ``DeferredMemory``, the snapshot is committed but its memory layer is still
        to be written by ``DeferredMemory.write`` (the caller must call it, and must not
        restore ``directory`` before it returned); ``note`` goes into the marker
        (``snapshots.PendingMemory``). By default (Firecracker: its own snapshot API
        writes memory with the state) the whole pause is done here, nothing deferred."""
        return await self.snapshot(directory, stop=True), None

    def deferred_memory(self, directory: Path) -> DeferredMemory:
        """The pending memory write of a pause into ``directory`` whose server stopped
        before writing it, for a VMM adopted after a restart (``Runtime.attach``)."""
        raise NotSupportedError("this driver does not defer a pause's memory",
                                vm_id=self.vm_id)

    def active_drive(self, drive_id: str) -> Path:
        """The host file the VM writes drive ``drive_id`` to now. A driver whose running
        snapshots move a drive onto a new file overrides this; by default it is the
        drive's fixed name in the working directory, resolved."""
        for fmt in ("qcow2", "raw"):
            path = self.workdir / f"{drive_id}.{fmt}"
            if path.exists():
                return path.resolve()
        raise VMError(f"no drive {drive_id} in {self.workdir}", vm_id=self.vm_id)

    @abc.abstractmethod
    async def stop(self, timeout: float = 5.0) -> None:
        """End the VMM: ask politely, then SIGTERM, then SIGKILL the process group."""

    @abc.abstractmethod
    async def wait(self) -> int | None:
        """Wait for the VMM to exit; its exit status when it was our child, else None."""

    async def detach(self) -> None:
        """Let go of the VMM without ending it (server shutdown): close the control
        connection, so that the next server's ``Runtime.attach`` can take the VMM over. The
        handle is not used afterwards. By default there is nothing to close."""
        return None


class Runtime(abc.ABC):
    """One driver per VMM; stateless apart from host facts it probed once."""

    name: str

    @abc.abstractmethod
    async def boot(self, spec: VMSpec) -> VM:
        """Start a VMM for ``spec``; returns when the VMM runs and answers control calls.

        On ``BootError`` no VMM process is left, but the working directory (with its logs
        and guest-RAM file) is: inspect it, then ``workdir.remove`` it.
        """

    @abc.abstractmethod
    async def restore(self, snapshot_dir: Path, overrides: RestoreOverrides) -> VM:
        """Start a new VMM from a snapshot written by ``VM.snapshot``, in the new working
        directory, tap and netns of ``overrides``; returns with the vCPUs running.

        Drives not named in ``overrides.drives`` get a fresh copy-on-write layer over the
        snapshot's in the working directory. The snapshot stays unchanged and must outlive
        the restored VM. On ``SnapshotError`` no VMM is left; the working directory is.
        """

    @abc.abstractmethod
    async def attach(self, workdir: Path) -> VM:
        """Re-attach to the live VMM of ``workdir`` (after a server restart)."""

    def prepare_compaction(self, directory: Path) -> Compaction | None:
        """When snapshot ``directory`` reads through a chain deeper than the driver keeps,
        make its shorter form beside it (blocking; O(data in the chain)) and return the
        steps that put it in place; None when there is nothing to do (or the directory is
        no complete snapshot). Also removes what an interrupted compaction of it left. By
        default a driver compacts inside its captures and returns None."""
        return None

    def cleanup_leftovers(self, vms_dir: Path, keep: set[str]) -> dict[str, list[str]]:
        """Remove the host objects of VMs a crashed server left (their cgroups, their VMM
        uids), except the VMs named in ``keep``; blocking. Run it at start-up after the
        working directories of lost VMs are removed. Returns what it did, by kind."""
        return {}
