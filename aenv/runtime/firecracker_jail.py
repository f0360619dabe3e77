"""Firecracker under its jailer: the command line, the chroot's contents, the cgroup arguments.

Written against the jailer's documented CLI (``docs/jailer.md`` of Firecracker v1.16.1):
``jailer --id <id> --exec-file <firecracker> --uid <uid> --gid <gid> --chroot-base-dir
<base> [--netns <path>] --cgroup-version <1|2> --parent-cgroup <rel> --cgroup
<file>=<value>... --resource-limit <res>=<value>... -- <firecracker args>``. The jailer
creates ``<base>/<exec name>/<id>/root``, copies the binary there, creates
``<cgroup root>/<parent>/<id>`` with the given values and moves itself in, unshares a mount
namespace and pivots into the root, makes ``/dev/kvm`` and ``/dev/net/tun`` there, chowns
the root to uid:gid, joins the netns, drops to uid:gid and execs Firecracker (same pid). So:

- ``--chroot-base-dir`` is ``<workdir>/jail``, and the jail root (``layout``) holds only what
  Firecracker opens, under the fixed names of ``aenv.runtime.workdir`` (``kernel``,
  ``initrd``, ``<drive>.raw``, ``console.log``) plus the API socket it creates. The server's
  own files (``vm.json``, ``vmm.pid``, ``vmm.log``) stay outside, where the VMM cannot reach
  or rewrite them. Files get in by hard link (``expose``): the VM's own files (its disks,
  its console log, a merged restore memory file) are given to its uid; shared files
  (kernel, base images, a snapshot's memory) are linked only where the VMM may read them
  anyway (world- or VMM-group-readable) and copied otherwise, never chowned.
- uid: the VM's own (``aenv.runtime.confine``); gid: the group all VMMs share
  (``confine.VMM_GID``), which is the group the network slots give their taps (SlotPool
  ``tap_gid``): an unprivileged Firecracker may attach to a tap its group owns, and each
  sees only its own tap (its netns).
- cgroup: the driver first makes ``<root>/<prefix>-vms/<id>`` itself with every limit
  (``memory.swap.max`` and the io weight too), then gives the jailer the single-dot files
  (``memory.max``, ``cpu.max``, ``pids.max``; v1: ``memory.limit_in_bytes``,
  ``cpu.cfs_*``) so it writes them again and attaches itself: the limits hold before
  Firecracker's first instruction. The jailer takes one parent path for every hierarchy,
  so on a v1 host the tree sits at each hierarchy's root, not under the server's cgroup.
- ``--resource-limit``: ``no-file`` (the jailer's own default, 2048, made explicit) and
  ``fsize`` above the largest file the VMM writes (guest RAM for a snapshot, its biggest
  disk), so a runaway write stops there.

No Firecracker binary or KVM is needed to build any of this; what a real jailer then does
with it is covered only by its documentation here (see ``tests/runtime/test_firecracker_jail.py``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .base import NotSupportedError
from .cgroups import Hierarchies, Hierarchy, Limits
from .confine import VMM_GID, Jail

JAILER_BINARY = "jailer"
JAIL_DIR = "jail"  # <workdir>/jail = --chroot-base-dir
NO_FILE = 2048
_ID = re.compile(r"[A-Za-z0-9-]{1,64}")


def jailer_binary() -> str | None:
    return shutil.which(JAILER_BINARY)


@dataclass(frozen=True)
class JailLayout:
    """Where one VM's jail lives. ``root`` is ``/`` for the jailed Firecracker."""

    base: Path
    root: Path

    @classmethod
    def of(cls, workdir: Path, vm_id: str, firecracker: str) -> JailLayout:
        check_id(vm_id)
        base = workdir / JAIL_DIR
        return cls(base, base / Path(firecracker).name / vm_id / "root")


def check_id(vm_id: str) -> None:
    """The jailer takes ids of letters, digits and hyphens, at most 64."""
    if not _ID.fullmatch(vm_id):
        raise NotSupportedError(f"the jailer needs a VM id of letters, digits and hyphens "
                                f"(at most 64): {vm_id!r}", vm_id=vm_id)


def cgroup_args(hierarchies: Hierarchies, limits: Limits
                ) -> tuple[tuple[str, str, list[str]], list[Hierarchy]]:
    """(``--cgroup-version``, ``--parent-cgroup``, ``--cgroup`` values) for the jailer, and
    the hierarchies it will put the VMM in: the version of the hierarchy that has the
    memory controller, the parent relative to that hierarchy's root, and the limit files
    of that version whose names have one dot (older jailers take no other; the io weight
    and ``memory.swap.max`` are written by the driver when it makes the cgroup). The
    jailer joins only hierarchies it writes a file in."""
    version = next((h.version for h in hierarchies.hierarchies if "memory" in h.controllers),
                   max((h.version for h in hierarchies.hierarchies), default=2))
    files, used = [], []
    for h in hierarchies.hierarchies:
        if h.version != version:
            continue
        mine = [f"{name}={value}" for name, value in h.limit_files(limits)
                if name.count(".") == 1 and name not in ("io.weight", "blkio.weight")]
        if mine:
            files += mine
            used.append(h)
    parent = str(hierarchies.parent_dir(used[0]).relative_to(used[0].mount)) if used else ""
    return (str(version), parent, files), used


def resource_limits(memory_mib: int, largest_file: int) -> list[str]:
    fsize = max(memory_mib << 20, largest_file) + (64 << 20)
    return [f"no-file={NO_FILE}", f"fsize={fsize}"]


def build_argv(jailer: str, firecracker: str, vm_id: str, jail: Jail, layout: JailLayout, *,
               netns: Path | None, cgroup: tuple[str, str, list[str]] | None,
               rlimits: list[str], api_socket: str) -> list[str]:
    """The jailer's command line for one VM (``firecracker`` must be an absolute path whose
    name contains "firecracker", as the jailer requires)."""
    if jail.uid is None:
        raise ValueError("a jailed Firecracker needs a uid of its own")
    argv = [jailer, "--id", vm_id, "--exec-file", firecracker,
            "--uid", str(jail.uid), "--gid", str(jail.gid),
            "--chroot-base-dir", str(layout.base)]
    if netns is not None:
        argv += ["--netns", str(netns)]
    if cgroup is not None:
        version, parent, files = cgroup
        argv += ["--cgroup-version", version, "--parent-cgroup", parent]
        for f in files:
            argv += ["--cgroup", f]
    for r in rlimits:
        argv += ["--resource-limit", r]
    return [*argv, "--", "--api-sock", api_socket]


# -- the chroot's contents --------------------------------------------------------------------


def make_root(layout: JailLayout, jail: Jail) -> None:
    """The jail root, before the jailer runs (it leaves an existing one as it is and chowns
    it to the VM's uid itself; it is made the uid's here too, so files can go in first)."""
    layout.root.mkdir(parents=True, exist_ok=True)
    jail.give(layout.root, 0o700)


def expose(src: Path, dest: Path, jail: Jail, *, own: bool, writable: bool = False) -> str:
    """Put ``src`` into the jail as ``dest``; returns how (``link``, ``reflink``, ``copy``).

    ``own``: the VM's own file (its disk, its log, its merged memory): linked and given to
    its uid (``writable``: 0600, else 0400). Otherwise a shared file, never chowned:
    linked when the VMM may read it as it is (other-readable, or group-readable by the VMM
    group), else copied and the copy given to the uid."""
    src = src.resolve()
    dest.unlink(missing_ok=True)
    if own and writable:
        try:
            os.link(src, dest)  # one inode: what the VM writes is what the server reads
        except OSError as e:
            raise NotSupportedError(f"{src} cannot be linked into the jail ({e.strerror}): "
                                    "a writable disk of a jailed VM must live on the "
                                    "filesystem of its working directory") from e
        jail.give(dest, 0o600)
        return "link"
    if own or _vmm_readable(src):
        how = _link_or_clone(src, dest)
        if own:
            jail.give(dest, 0o400)
        return how
    from .firecracker_snapshot import clone

    how = clone(src, dest)[0]
    jail.give(dest, 0o400)
    return how


def expose_console(workdir: Path, root: Path, jail: Jail, name: str) -> None:
    """The serial log Firecracker appends to, as ``<root>/<name>`` and, for the server,
    ``<workdir>/<name>`` (one file: a hard link; on another filesystem the working
    directory's name becomes a symlink to the jail's file)."""
    host = workdir / name
    target = host.resolve() if host.exists() else host
    if not target.exists():
        target.touch()
    dest = root / name
    dest.unlink(missing_ok=True)
    try:
        os.link(target, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        dest.touch()
        host.unlink(missing_ok=True)
        host.symlink_to(dest)
    jail.give(dest, 0o600)


def take_back_shared(path: Path) -> None:
    """A file that leaves the VM for a snapshot: root's, readable by VMMs (the VMM group)
    so later jails can link it instead of copying it, and by nobody else."""
    if os.geteuid() == 0:
        os.chown(path, 0, VMM_GID, follow_symlinks=False)
    os.chmod(path, 0o640)


def move_out(src: Path, dest: Path) -> None:
    """A file Firecracker wrote in its jail, moved to where the server keeps it."""
    try:
        os.replace(src, dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.move(src, dest)


def _vmm_readable(path: Path) -> bool:
    st = os.stat(path)
    return bool(st.st_mode & stat.S_IROTH) or (st.st_gid == VMM_GID
                                              and bool(st.st_mode & stat.S_IRGRP))


def _link_or_clone(src: Path, dest: Path) -> str:
    try:
        os.link(src, dest)
        return "link"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EMLINK, errno.EPERM):
            raise
    from .firecracker_snapshot import clone

    return clone(src, dest)[0]
