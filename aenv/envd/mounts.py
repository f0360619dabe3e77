"""Volume mounts inside the guest: ``/init``'s ``volumeMounts`` as NFSv4 mounts.

The host serves each sandbox's volumes from an NFS server in the sandbox's own network
namespace, on the gateway address (``aenv.storage.volume_server``); ``nfsTarget`` is
``<address>:/<export>``. envd mounts them with ``mount(2)`` itself — the image may have no
``mount.nfs`` (nfs-common), and the kernel needs none when the server's address is given
as ``addr=`` — after loading the kernel's NFS modules from the image's ``/lib/modules``
(the cloud kernel builds them as modules; every image made for it carries its module
tree). A path that already holds an NFS mount is left alone: a restored or forked guest
kept its mount in memory, and its NFS client reconnects to the new namespace's server.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Any

# NFSv4.2 over TCP. hard: a guest never sees EIO while its server restarts (a restore
# or fork brings a new one up at the same address). actimeo=1 bounds how stale another
# sandbox's writes to the same volume can look; close-to-open holds as always.
OPTIONS = "vers=4.2,proto=tcp,port=2049,hard,timeo=50,retrans=2,actimeo=1"
_SYS_FINIT_MODULE = 313  # x86_64
_MODULES = ("nfsv4",)


class MountError(Exception):
    pass


def parse(raw: Any) -> list[dict[str, str]]:
    """Validate ``volumeMounts``: a list of ``{name, path, nfsTarget}`` strings."""
    if not isinstance(raw, list):
        raise MountError("volumeMounts must be a list")
    out = []
    for m in raw:
        if not (isinstance(m, dict) and all(isinstance(m.get(k), str) and m[k]
                                            for k in ("name", "path", "nfsTarget"))):
            raise MountError("each volumeMounts entry needs name, path and nfsTarget strings")
        if not m["path"].startswith("/") or "," in m["nfsTarget"]:
            raise MountError(f"bad volume mount {m['name']}")
        out.append({k: m[k] for k in ("name", "path", "nfsTarget")})
    return out


def nfs_mounts() -> set[str]:
    """Mount points of NFS filesystems in this mount namespace."""
    out = set()
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2].startswith("nfs"):
                out.add(fields[1].replace("\\040", " "))
    return out


def _has_nfs4() -> bool:
    with open("/proc/filesystems", encoding="utf-8") as f:
        return any(line.split()[-1:] == ["nfs4"] for line in f)


def _module_index(root: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for directory, _, files in os.walk(root / "kernel"):
        for f in files:
            if f.endswith(".ko"):
                index[f[:-3].replace("-", "_")] = Path(directory) / f
    return index


def _depends(path: Path) -> list[str]:
    m = re.search(rb"(?:^|\0)depends=([^\0]*)", path.read_bytes())
    return [d.decode().replace("-", "_") for d in m.group(1).split(b",") if d] if m else []


def load_modules(root: Path | None = None) -> None:
    """Insert the NFSv4 client and what it depends on (built-ins are not in the index and
    are skipped), dependencies first."""
    if _has_nfs4():
        return
    root = root or Path("/lib/modules") / os.uname().release
    index = _module_index(root)
    if "nfsv4" not in index:
        raise MountError(f"the image has no NFSv4 module under {root}")
    libc = ctypes.CDLL(None, use_errno=True)
    done: set[str] = set()

    def insert(name: str) -> None:
        if name in done or name not in index:
            return
        done.add(name)
        for dep in _depends(index[name]):
            insert(dep)
        fd = os.open(index[name], os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.syscall(_SYS_FINIT_MODULE, fd, b"", 0) != 0:
                err = ctypes.get_errno()
                if err != 17:  # EEXIST: loaded already
                    raise MountError(f"loading module {name}: {os.strerror(err)}")
        finally:
            os.close(fd)

    for name in _MODULES:
        insert(name)


def mount_all(mounts: list[dict[str, str]]) -> None:
    """Mount every volume not mounted yet (blocking: call it off the event loop)."""
    present = nfs_mounts()
    todo = [m for m in mounts if os.path.normpath(m["path"]) not in present]
    if not todo:
        return
    load_modules()
    libc = ctypes.CDLL(None, use_errno=True)
    for m in todo:
        path = os.path.normpath(m["path"])
        os.makedirs(path, exist_ok=True)
        server = m["nfsTarget"].split(":", 1)[0]
        data = f"{OPTIONS},addr={server}".encode()
        if libc.mount(m["nfsTarget"].encode(), path.encode(), b"nfs4", 0, data) != 0:
            err = ctypes.get_errno()
            raise MountError(f"mounting volume {m['name']} at {path}: {os.strerror(err)}")
