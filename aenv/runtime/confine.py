"""Confinement of VMM processes: the server prepares, the VMM runs unprivileged and boxed in.

A VMM is the one process that parses guest-controlled data (virtio rings, MMIO, device
state), so it gets no more than one VM needs. ``prepare`` makes a ``Jail`` for a VM before
its VMM starts; the driver turns it into the VMM's command line (``qemu_args``) and its
spawn (``wrap``), records it in the VM's manifest (``record``) and calls ``release`` once
the VMM has exited (``workdir.remove`` does too, for VMs that died unseen).

What a jailed QEMU gets (``Confinement`` says which parts are on):
- **its own uid**, one per VM, from a range no account uses (from ``UID_BASE``,
  0x70000001: the range systemd's UIDS-GIDS.md lists as unused starts at 1879048192 =
  0x70000000, above the container ranges, below the signedness trouble at 2^31), and the
  group all VMMs share (``VMM_GID`` = 0x70000000; see there why). A uid per VM rather
  than one shared ``aenv-vmm`` user: processes of one uid may signal each other
  (``kill`` is in no seccomp profile QEMU offers), so a shared uid would let a compromised
  VMM kill every other sandbox. No passwd entry is needed (``-runas uid:gid``); the
  allocation is a file per uid under ``ids_dir`` (``/run``: gone at reboot, like the VMMs),
  created with ``O_EXCL`` under a lock, so servers with different prefixes never share a uid.
  QEMU drops to it itself (``-runas``) at the end of its start-up, after it opened
  everything on its command line as root (tap, disks and their backing chains, guest RAM,
  console, QMP socket); it cannot regain root, and since its credentials changed it is not
  dumpable: another process of the same uid could not ptrace it even if there were one.
- **seccomp** (``-sandbox on,obsolete=deny,spawn=deny,resourcecontrol=deny``): no fork or
  exec, no obsolete system calls, no scheduler or priority changes. ``elevateprivileges=
  deny`` is left out: QEMU installs its filter first and changes uid afterwards, so with it
  ``-runas`` dies of SIGSYS in setgid (measured, QEMU 7.2). After ``-runas`` the process
  has no capabilities and all of its uids are unprivileged, so a set*id call can only fail
  or go nowhere: the item would add nothing but the crash.
- **a chroot into its working directory** (``-chroot .``, after start-up like ``-runas``):
  the only paths it can name are the fixed names of ``aenv.runtime.workdir``. Everything
  QEMU opens later is either a file descriptor the server passes (device state for a
  snapshot: ``add-fd``; a restore's state: an inherited fd) or a file the driver creates in
  the working directory and gives to the VM's uid first (the overlay a running snapshot
  switches to).
- **a cgroup** (``aenv.runtime.cgroups``) with ``memory.max``, ``memory.swap.max``,
  ``cpu.max``, ``pids.max`` and the io weight from the VM's size (``limits_for``). A boot
  is spawned as ``sh -c 'echo $$ > <cgroup>/cgroup.procs ...; exec <argv>'``: the process
  is in its cgroup before it execs the VMM, so all it ever allocates is charged there. A
  restore starts with its vCPUs stopped (``-S``) and no guest memory written, so the
  driver moves it in (``Jail.join``) while it starts up instead, and waits for that before
  it writes guest memory or starts a vCPU: the migration's wait for an RCU grace period
  (~10 ms, measured on this host) then overlaps QEMU's own ~25 ms of start-up. What QEMU
  allocated before the move (its libraries' and heap's first pages, a few MiB) stays
  charged to the server.

Files the server makes for the VMM stay root's (guest RAM in ``/dev/shm`` is 0600 root:
QEMU opens it before it drops to its uid); only files the VMM must open *after* start-up are
given to its uid, and given back to root when they leave the VM (a snapshot's layers).

Without root (a developer running tests as a user) there is no uid to drop to, no chroot and
usually no cgroup: ``prepare`` then applies the seccomp filter only and logs once what it left
out. ``cgroups="required"`` makes a missing cgroup an error instead.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .base import VMError, VMLimits
from .cgroups import CgroupError, Hierarchies, Limits, VMCgroup, sweep

log = logging.getLogger("aenv.runtime")

# The group of every VMM (no /etc/group entry needed): it owns the network slots' taps
# (SlotPool tap_gid), so that a VMM that opens its tap after dropping root (Firecracker
# under its jailer) may attach to it, and it may read snapshot files the server shares
# with VMMs (mode 0640 root:VMM_GID). Each VMM sees only its own tap, in its own netns.
VMM_GID = 0x7000_0000
UID_BASE = VMM_GID + 1
UID_COUNT = 65535
IDS_DIR = Path("/run/aenv-vmm-ids")
QEMU_SECCOMP = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
# Memory a VMM needs beyond guest RAM (measured under QEMU 7.2, 512 MiB guest, TCG: ~40 MiB
# of heap, stacks and device buffers besides the translation cache, plus the host page
# cache of its disks, which is charged to it but reclaimable): a fixed part and a part that
# grows with guest RAM (page tables, dirty bitmaps, virtio queues).
OVERHEAD_FIXED = 160 << 20
OVERHEAD_FRACTION = 8  # + guest RAM / 8
CPU_PERIOD_US = 100_000
CPU_HEADROOM = 0.25  # of a CPU, for the VMM's own threads beside the vCPUs (device emulation)
# Threads of one QEMU: main loop, RCU, one per vCPU, up to 64 block I/O workers per
# AioContext (aio=threads, and for what io_uring does not do), io_uring's kernel workers
# (they count as tasks of the process; up to 4 per host CPU bound to each ring, and QEMU
# has a ring per AioContext): generous, it only has to stop a runaway. Measured: 6
# threads for a 1-vCPU TCG guest at rest.
PIDS_FIXED = 160
PIDS_PER_VCPU = 8
PIDS_PER_HOST_CPU = 8
_SH_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_STALE_S = 60.0  # a reservation no process uses for this long is a crashed boot's


class ConfinementError(VMError):
    """The VMM could not be confined as required (no uid left, no cgroup)."""


@dataclass(frozen=True)
class Confinement:
    """How VMMs of one runtime are confined (host-wide policy; see the module docstring).

    ``prefix`` names this server's cgroup tree (``<prefix>-vms``), as ``Settings.name_prefix``
    names its other host objects. ``cgroups``: ``auto`` uses them where the host has them,
    ``required`` refuses to start a VMM without, ``off`` never makes one. ``cgroup_parent``:
    see ``aenv.runtime.cgroups``."""

    prefix: str = "aenv"
    unprivileged: bool = True
    seccomp: bool = True
    chroot: bool = True
    cgroups: Literal["auto", "required", "off"] = "auto"
    cgroup_parent: str | None = None
    uid_base: int = UID_BASE
    uid_count: int = UID_COUNT
    vmm_gid: int = VMM_GID
    ids_dir: Path = IDS_DIR

    def __post_init__(self) -> None:
        if self.cgroups not in ("auto", "required", "off"):
            raise ValueError(f"cgroups must be auto, required or off: {self.cgroups!r}")
        if not self.uid_base > 0 or self.uid_base + self.uid_count > 0x8000_0000:
            raise ValueError("the VMM uid range must lie within 1..2^31-1")
        if self.uid_base <= self.vmm_gid < self.uid_base + self.uid_count:
            raise ValueError("the VMM group must not be one of the VMM uids")

    @classmethod
    def off(cls) -> Confinement:
        """VMMs run as the server does, unconfined (the behaviour before confinement)."""
        return cls(unprivileged=False, seccomp=False, chroot=False, cgroups="off")

    @classmethod
    def from_settings(cls, settings: Any, **kw: Any) -> Confinement:
        """This server's policy: its name prefix, defaults otherwise."""
        return cls(prefix=settings.name_prefix, **kw)

    def hierarchies(self, *, at_root: bool = False) -> Hierarchies:
        """Where this policy's VM cgroups go; ``at_root``: under each hierarchy's root (or
        ``cgroup_parent``) even on v1 (see ``prepare``)."""
        if at_root:
            return _hierarchies(self.prefix, self.cgroup_parent or "")
        return _hierarchies(self.prefix, self.cgroup_parent)


@functools.cache
def _hierarchies(prefix: str, parent: str | None) -> Hierarchies:
    return Hierarchies.discover(prefix=prefix, parent=parent)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def limits_for(vcpus: int, memory_mib: int, *, tcg_tb_mib: int | None = None,
               overrides: VMLimits | None = None) -> Limits:
    """The cgroup limits of a VM of this size: guest RAM plus the VMM's overhead (and,
    under TCG, its translation cache of ``tcg_tb_mib``), ``vcpus`` CPUs plus a quarter for
    device emulation, the io weight in proportion to vCPUs. ``overrides`` wins field by
    field."""
    guest = memory_mib << 20
    memory = guest + guest // OVERHEAD_FRACTION + OVERHEAD_FIXED + ((tcg_tb_mib or 0) << 20)
    quota: int | None = int((vcpus + CPU_HEADROOM) * CPU_PERIOD_US)
    o = overrides or VMLimits()
    if o.cpus is not None:
        quota = int(o.cpus * CPU_PERIOD_US) if o.cpus > 0 else None
    return Limits(
        memory_max=o.memory_bytes if o.memory_bytes is not None else memory,
        pids_max=o.pids if o.pids is not None else (
            PIDS_FIXED + PIDS_PER_VCPU * vcpus + PIDS_PER_HOST_CPU * (os.cpu_count() or 1)),
        cpu_quota_us=quota,
        cpu_period_us=CPU_PERIOD_US,
        swap_max=0,
        io_weight=o.io_weight if o.io_weight is not None else min(10000, 100 * vcpus),
    )


@dataclass
class Jail:
    """The confinement of one VM's VMM. ``uid``/``gid`` None: it runs as the server."""

    vm_id: str
    workdir: Path
    uid: int | None = None
    gid: int | None = None
    seccomp: bool = False
    chroot: bool = False
    cgroup: VMCgroup | None = None
    limits: Limits | None = None
    ids_dir: Path = IDS_DIR
    released: bool = field(default=False, compare=False)

    # -- what the driver puts on the command line -------------------------------------------

    def qemu_args(self) -> list[str]:
        """``-sandbox``, ``-runas`` and ``-chroot`` for QEMU 7.2 (``-run-with`` replaces
        the last two from QEMU 9.1)."""
        args: list[str] = []
        if self.seccomp:
            args += ["-sandbox", QEMU_SECCOMP]
        if self.chroot:
            args += ["-chroot", "."]  # the cwd, i.e. the working directory
        if self.uid is not None:
            args += ["-runas", f"{self.uid}:{self.gid}"]
        return args

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside the cgroup: a shell writes its own pid into each
        hierarchy's ``cgroup.procs`` and then execs ``argv`` (same pid)."""
        if self.cgroup is None:
            return argv
        return ["/bin/sh", "-c", _SH_JOIN, "aenv-cgroup-join",
                *map(str, self.cgroup.procs_files), "--", *argv]

    def join(self, pid: int) -> None:
        """Move a running process (all its threads) into the cgroup (blocking: a cgroup
        migration waits for an RCU grace period, ~10 ms when none is under way). For a VMM
        that runs no guest code yet (``-S``): done beside its start-up, it costs no time."""
        if self.cgroup is None:
            return
        for f in self.cgroup.procs_files:
            f.write_text(str(pid))

    def give(self, path: Path, mode: int = 0o600) -> None:
        """Hand a file the VMM must open after its start-up to the VMM's uid."""
        if self.uid is not None:
            os.chown(path, self.uid, self.gid if self.gid is not None else self.uid,
                     follow_symlinks=False)
        os.chmod(path, mode)

    @staticmethod
    def take_back(path: Path) -> None:
        """A file that leaves the VM (a snapshot's layer) goes back to root, so a later VMM
        that gets the same uid cannot open it."""
        if os.geteuid() == 0:
            os.chown(path, 0, 0, follow_symlinks=False)

    # -- record and release ------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """What the manifest keeps, so ``attach`` and ``workdir.remove`` can release it."""
        return {
            "uid": self.uid, "gid": self.gid, "seccomp": self.seccomp, "chroot": self.chroot,
            "cgroup": [str(d) for d in self.cgroup.dirs] if self.cgroup else [],
            "limits": self.limits.as_dict() if self.limits else None,
            "ids_dir": str(self.ids_dir),
        }

    @classmethod
    def from_record(cls, vm_id: str, workdir: Path, record: dict[str, Any] | None) -> Jail:
        if not record:
            return cls(vm_id, workdir, released=True)
        dirs = tuple(Path(d) for d in record.get("cgroup") or ())
        lim = record.get("limits")
        return cls(vm_id, workdir, uid=record.get("uid"), gid=record.get("gid"),
                   seccomp=bool(record.get("seccomp")), chroot=bool(record.get("chroot")),
                   cgroup=VMCgroup(vm_id, dirs) if dirs else None,
                   limits=Limits(**lim) if lim else None,
                   ids_dir=Path(record.get("ids_dir") or IDS_DIR))

    def release(self) -> bool:
        """After the VMM exited: remove the cgroup, free the uid. Nothing is freed while a
        process still runs in the cgroup (or, without one, under the uid). Idempotent;
        True once everything is released."""
        if self.released:
            return True
        if self.cgroup is not None:
            if self.cgroup.pids() or not self.cgroup.remove():
                return False
        elif self.uid is not None and self.uid in _uids_in_use():
            return False
        if self.uid is not None:
            _free_uid(self.ids_dir, self.uid, self.workdir)
        self.released = True
        return True


def read_record(workdir: Path) -> dict[str, Any] | None:
    """The ``confinement`` entry of a working directory's manifest, if any."""
    from .workdir import MANIFEST

    try:
        record: dict[str, Any] | None = json.loads(
            (workdir / MANIFEST).read_text()).get("confinement")
    except (OSError, ValueError, AttributeError):
        return None
    return record


def prepare(conf: Confinement, vm_id: str, workdir: Path, *, vcpus: int, memory_mib: int,
            tcg_tb_mib: int | None = None, overrides: VMLimits | None = None,
            cgroup_at_root: bool = False) -> Jail:
    """Reserve a uid and make the cgroup for one VM (blocking: call it in a thread).
    Raises ``ConfinementError`` with nothing reserved when a required part fails.
    ``cgroup_at_root``: the tree goes at each hierarchy's root (or ``cgroup_parent``) even
    on v1, for a spawner that takes one parent path for all hierarchies (the jailer)."""
    root = os.geteuid() == 0
    jail = Jail(vm_id, workdir, seccomp=conf.seccomp, ids_dir=conf.ids_dir)
    if not root and (conf.unprivileged or conf.chroot or conf.cgroups == "auto"):
        _warn_once("aenv is not running as root: VMMs run with seccomp only (no uid of "
                   "their own, no chroot, no cgroup)")
    if root and conf.unprivileged:
        jail.uid = _reserve_uid(conf, vm_id, workdir)
        jail.gid = conf.vmm_gid
    jail.chroot = root and conf.chroot
    if conf.cgroups == "off" or (not root and conf.cgroups == "auto"):
        return jail
    limits = limits_for(vcpus, memory_mib, tcg_tb_mib=tcg_tb_mib, overrides=overrides)
    try:
        hierarchies = conf.hierarchies(at_root=cgroup_at_root)
        if not hierarchies.hierarchies:
            raise CgroupError("this host mounts none of the memory, cpu, pids and io "
                              "controllers")
        missing = {"memory", "pids"} - hierarchies.controllers
        if missing and conf.cgroups == "required":
            raise CgroupError(f"no cgroup controller for {', '.join(sorted(missing))}")
        jail.cgroup = hierarchies.create(vm_id, limits)
        jail.limits = limits
    except (CgroupError, ValueError) as e:
        if conf.cgroups == "required":
            jail.release()
            raise ConfinementError(f"no cgroup for {vm_id}: {e}", vm_id=vm_id) from e
        _warn_once(f"VMMs run without a cgroup of their own: {e}")
    return jail


def cleanup_leftovers(conf: Confinement, vms_dir: Path, keep: Iterable[str] = ()
                      ) -> dict[str, list[str]]:
    """What a crashed server left: VM cgroups of this prefix not in ``keep`` (those with a
    VMM still inside are killed first when that VMM ran from ``vms_dir``), and uid
    reservations of VMs in ``vms_dir`` that are gone. Returns what was removed and left."""
    keep = set(keep)
    root = str(vms_dir.resolve()) + os.sep

    def ours(pid: int, name: str) -> bool:
        """The process runs from our working directory ``name``: its cwd is there, or (a
        jailed VMM, whose cwd the host cannot name) it is the root of that VM's jail."""
        try:
            if (os.readlink(f"/proc/{pid}/cwd") + os.sep).startswith(root):
                return True
            cwd = os.stat(f"/proc/{pid}/cwd")
        except OSError:
            return True  # already gone
        for jail_root in (vms_dir / name).glob(f"jail/*/{name}/root"):
            try:
                st = jail_root.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (cwd.st_dev, cwd.st_ino):
                return True
        return False

    report: dict[str, list[str]] = {"cgroups_removed": [], "cgroups_left": [],
                                    "uids_freed": []}
    if conf.cgroups != "off" and os.geteuid() == 0:
        try:
            trees = {tuple(h.parent_dirs()): h for h in (
                conf.hierarchies(), conf.hierarchies(at_root=True))}
            for h in trees.values():
                removed, left = sweep(h, keep, ours)
                report["cgroups_removed"] += removed
                report["cgroups_left"] += left
        except CgroupError as e:
            log.warning("cgroup leftovers not checked: %s", e)
    report["uids_freed"] = _sweep_uids(conf.ids_dir, vms_dir, keep)
    return report


# -- uid reservations ---------------------------------------------------------------------------


def _reserve_uid(conf: Confinement, vm_id: str, workdir: Path) -> int:
    conf.ids_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = json.dumps({"vm_id": vm_id, "workdir": str(workdir.resolve()),
                        "at": time.time()}).encode()
    with _locked(conf.ids_dir):
        for attempt in range(2):
            taken = {int(n) for n in os.listdir(conf.ids_dir) if n.isdigit()}
            for uid in range(conf.uid_base, conf.uid_base + conf.uid_count):
                if uid in taken:
                    continue
                fd = os.open(conf.ids_dir / str(uid),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600)
                try:
                    os.write(fd, entry)
                finally:
                    os.close(fd)
                return uid
            if attempt == 0:
                _free_stale(conf.ids_dir, range(conf.uid_base, conf.uid_base + conf.uid_count))
    raise ConfinementError(f"all {conf.uid_count} VMM uids from {conf.uid_base} are in use",
                           vm_id=vm_id)


def _free_uid(ids_dir: Path, uid: int, workdir: Path) -> None:
    path = ids_dir / str(uid)
    with _locked(ids_dir):
        try:
            owner = json.loads(path.read_text()).get("workdir")
        except (OSError, ValueError):
            return
        if owner == str(workdir.resolve()):
            path.unlink(missing_ok=True)


def _free_stale(ids_dir: Path, uids: range) -> list[str]:
    """Reservations (lock held) older than ``_STALE_S`` that no process runs under."""
    in_use = _uids_in_use()
    freed = []
    now = time.time()
    for name in os.listdir(ids_dir):
        if not name.isdigit() or int(name) not in uids or int(name) in in_use:
            continue
        path = ids_dir / name
        try:
            if now - path.stat().st_mtime > _STALE_S:
                path.unlink()
                freed.append(name)
        except OSError:
            continue
    return freed


def _sweep_uids(ids_dir: Path, vms_dir: Path, keep: set[str]) -> list[str]:
    """Reservations of VMs of ``vms_dir`` that are not kept and run no process."""
    if not ids_dir.is_dir():
        return []
    root = str(vms_dir.resolve()) + os.sep
    in_use = _uids_in_use()
    freed = []
    with _locked(ids_dir):
        for name in os.listdir(ids_dir):
            if not name.isdigit() or int(name) in in_use:
                continue
            path = ids_dir / name
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            wd = str(entry.get("workdir", ""))
            if (wd + os.sep).startswith(root) and entry.get("vm_id") not in keep:
                path.unlink(missing_ok=True)
                freed.append(name)
    return freed


def _uids_in_use() -> set[int]:
    """Every uid a process on the host runs under (one pass over /proc; the owner of
    ``/proc/<pid>`` will not do: it is root for a process that is not dumpable, which a
    QEMU after ``-runas`` is)."""
    uids: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uids.update(int(x) for x in line.split()[1:])
                        break
        except OSError:
            continue
    return uids


class _locked:
    """An exclusive flock on ``<dir>/.lock`` (host-wide: every server shares the range)."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / ".lock"
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


