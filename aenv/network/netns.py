"""Named network namespaces without forking: create, enter, remove, list, find processes.

A namespace is named like iproute2 names it (a bind mount of the nsfs file at
``/run/netns/<name>``), so ``ip netns exec`` and ``ip -n`` see ours. Entering one is done
in a fresh thread that calls ``setns(2)`` and dies afterwards: on Linux a network namespace
belongs to a thread, so the rest of the process stays on the host. Sockets opened in that
thread (netlink, conntrack) keep the namespace for their lifetime, and children spawned from
it (``nft``, a VMM) start inside it: that is how callers use ``run_in``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from .errors import NetnsError

NETNS_DIR = Path("/run/netns")

_CLONE_NEWNET = 0x40000000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_SHARED = 1 << 20
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_dir_lock = threading.Lock()
_dir_ready = False

T = TypeVar("T")


def _check(rc: int, what: str, name: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"{what} for netns {name}: {os.strerror(err)}")


def _prepare_dir() -> None:
    """Make ``/run/netns`` a shared mount, as iproute2 does, so that unmounting a namespace
    here also unmounts it in mount namespaces copied from ours (``ip netns exec`` makes
    one per command); otherwise such a copy would keep the namespace alive."""
    global _dir_ready
    with _dir_lock:
        if _dir_ready:
            return
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        d = str(NETNS_DIR).encode()
        if _libc.mount(b"none", d, None, _MS_SHARED | _MS_REC, None) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                _check(-1, "make /run/netns shared", "*")
            # Not a mount point yet: bind it onto itself, then share it.
            _check(_libc.mount(d, d, b"none", _MS_BIND | _MS_REC, None), "bind /run/netns", "*")
            _check(_libc.mount(b"none", d, None, _MS_SHARED | _MS_REC, None),
                   "make /run/netns shared", "*")
        _dir_ready = True


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a new thread and return its result or raise its exception."""
    box: dict[str, object] = {}

    def main() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=main, name="aenv-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return path(name).exists()


def create(name: str, setup: Callable[[], T]) -> T:
    """Create the namespace ``name`` and run ``setup`` inside it; return what it returns.

    If ``setup`` raises, the namespace still exists: remove it with ``remove(name)``.
    """
    _prepare_dir()
    p = path(name)
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0))
    except FileExistsError:
        raise NetnsError(f"netns {name} already exists") from None

    def main() -> T:
        _check(_libc.unshare(_CLONE_NEWNET), "unshare", name)
        src = b"/proc/thread-self/ns/net"
        _check(_libc.mount(src, str(p).encode(), b"none", _MS_BIND, None), "bind mount", name)
        return setup()

    try:
        return _in_thread(main)
    except NetnsError:
        if not _is_mounted(p):
            p.unlink(missing_ok=True)
        raise


def run_in(name: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` inside the namespace ``name`` (in a short-lived thread)."""
    p = path(name)

    def main() -> T:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NetnsError(f"netns {name} does not exist") from None
        try:
            _check(_libc.setns(fd, _CLONE_NEWNET), "setns", name)
        finally:
            os.close(fd)
        return fn()

    return _in_thread(main)


def _is_mounted(p: Path) -> bool:
    try:
        return os.stat(p).st_dev != os.stat(p.parent).st_dev
    except FileNotFoundError:
        return False


def remove(name: str) -> bool:
    """Unmount and delete the name; the namespace dies when no process or socket holds it.
    Returns False when there was nothing to remove."""
    p = path(name)
    if not p.exists():
        return False
    if _libc.umount2(str(p).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: a plain file, never mounted
            raise NetnsError(f"umount netns {name}: {os.strerror(err)}")
    p.unlink(missing_ok=True)
    return True


def list_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def pids_in(names: Iterable[str]) -> dict[str, list[int]]:
    """Processes whose network namespace is one of ``names`` (matched by nsfs inode)."""
    by_inode: dict[tuple[int, int], str] = {}
    for name in names:
        try:
            st = os.stat(path(name))
        except FileNotFoundError:
            continue
        by_inode[(st.st_dev, st.st_ino)] = name
    found: dict[str, list[int]] = {}
    if not by_inode:
        return found
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:  # gone, or a kernel thread we may not inspect
            continue
        owner = by_inode.get((st.st_dev, st.st_ino))
        if owner is not None:
            found.setdefault(owner, []).append(int(entry.name))
    return found


def sysctl(key: str, value: str | int, *, missing_ok: bool = False) -> None:
    """Write a sysctl (``net.ipv4.ip_forward`` style) of the calling thread's namespace.
    ``missing_ok`` for keys that may not exist (IPv6 ones on a host booted without IPv6)."""
    try:
        with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise
