"""The per-VM working directory: fixed relative names that every VMM command line uses.

The VMM runs with its cwd set to this directory and refers to files only by the names below,
so two sandboxes have identical command lines and a snapshot taken in one restores in another.
``prepare`` links the spec's host paths to those names (symlinks: the kernel and base images
are shared and read-only, the per-sandbox disk usually already lives here) and creates the
guest-RAM file; ``remove`` deletes the directory and the RAM file it points to.

Guest RAM lives on tmpfs (``/dev/shm``) when the host has one: a ``share=on`` mapping of a
file on a disk filesystem would make the host write every page the guest dirties back to disk,
while tmpfs keeps it in memory and can still be mapped copy-on-write by a restore. Without a
tmpfs the file sits in the working directory. The file is made afresh for every boot, mode
0600 and owned by root (the VMM opens it before it drops to its own uid), with ``O_EXCL``
and without following a symlink: ``/dev/shm`` is writable by every local user, and a link
or file planted under the name must neither become guest RAM nor get truncated.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from . import confine
from .base import Drive, VMError, VMSpec

KERNEL = "kernel"
INITRD = "initrd"
MEMORY = "memory"
# A restored VM maps its snapshot's base memory image copy-on-write under this name; it is
# the snapshot's file, not the VM's, so ``remove`` leaves it alone (unlike ``memory``).
BASE_MEMORY = "base-memory"
LINEAGE = "lineage.json"  # which snapshot a VM derives from (``qemu_snapshot``)
CONSOLE = "console.log"
QMP_SOCKET = "qmp.sock"
PIDFILE = "vmm.pid"
VMM_LOG = "vmm.log"
MANIFEST = "vm.json"

SHM = Path("/dev/shm")


def drive_name(drive: Drive) -> str:
    """The fixed name a drive has in every working directory, e.g. ``rootfs.qcow2``."""
    return f"{drive.id}.{drive.format}"


def ram_file_dir() -> Path | None:
    """The tmpfs where booted VMs keep guest RAM files, or None when they keep them in
    their working directory (no writable tmpfs on ``/dev/shm``)."""
    return SHM if _is_tmpfs(SHM) and os.access(SHM, os.W_OK) else None


def default_memory_file(vm_id: str, workdir: Path, prefix: str = "aenv") -> Path:
    """Where guest RAM of ``vm_id`` should live on this host (see the module docstring)."""
    shm = ram_file_dir()
    if shm is not None:
        return shm / f"{prefix}-vm-{vm_id}.mem"
    return workdir / MEMORY


def prepare(spec: VMSpec) -> None:
    """Create ``spec.workdir`` with every fixed name pointing at the spec's host files."""
    wd = spec.workdir
    wd.mkdir(parents=True, exist_ok=True)
    _link(wd / KERNEL, spec.kernel)
    if spec.initrd is not None:
        _link(wd / INITRD, spec.initrd)
    for drive in spec.drives:
        _link(wd / drive_name(drive), drive.path)
    if spec.console_log is not None:
        spec.console_log.parent.mkdir(parents=True, exist_ok=True)
        spec.console_log.touch()
        _link(wd / CONSOLE, spec.console_log)
    if spec.memory_file is not None:
        # QEMU opens mem-path with O_CREAT|O_EXCL when it is missing, which loops forever on
        # a dangling symlink: the file must exist, at full size, before the VMM starts.
        spec.memory_file.parent.mkdir(parents=True, exist_ok=True)
        create_memory_file(spec.memory_file, spec.memory_mib << 20)
        _link(wd / MEMORY, spec.memory_file)
    for stale in (QMP_SOCKET, PIDFILE):
        (wd / stale).unlink(missing_ok=True)


def create_memory_file(path: Path, size: int) -> None:
    """A new, empty guest-RAM file of ``size`` bytes: 0600, this process's, created with
    ``O_EXCL | O_NOFOLLOW``. A regular file of ours already there is a crashed VM's and is
    replaced; anything else under the name (another user's file, a symlink) is refused."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise VMError(f"{path} exists and is not a guest-RAM file of ours (mode "
                          f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): refusing it"
                          ) from None
        path.unlink()
        fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def remove(workdir: Path) -> None:
    """Delete a working directory and the guest-RAM file its ``memory`` link points to, and
    release the VMM's confinement (cgroup, uid: ``aenv.runtime.confine``) if nobody did;
    call it once the VMM is gone."""
    record = confine.read_record(workdir)
    if record:
        confine.Jail.from_record(workdir.name, workdir, record).release()
    mem = workdir / MEMORY
    if mem.is_symlink():
        Path(os.readlink(mem)).unlink(missing_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file (console, VMM log), for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _link(name: Path, target: Path) -> None:
    target = target.resolve()
    if name.resolve() == target and not name.is_symlink():
        return  # the file already lives here under its fixed name
    if name.is_symlink() or name.exists():
        name.unlink()
    name.symlink_to(target)


def _is_tmpfs(path: Path) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return False
    return any(mnt == str(path) and fstype == "tmpfs" for mnt, fstype in mounts)
