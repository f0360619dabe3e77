"""One userspace NFS server (nfs-ganesha) per sandbox that mounts volumes, inside the
sandbox's own network namespace, serving only that sandbox's volumes.

Why NFS, and why this way. The choices for sharing a host directory with a running guest
here: virtio-fs needs ``virtiofsd`` (not in Debian bookworm) and QEMU 7.2 cannot migrate
vhost-user-fs devices, so a VM with one could not be snapshotted, paused or forked; 9p is
not in the guest kernel; a block device per volume allows one writer only and would put the
volume's blocks into every snapshot. NFSv4 needs nothing from the VMM: the guest kernel has
the client (as modules, which every image for it carries), and the host kernel has no nfsd,
so the server is nfs-ganesha (Debian ``nfs-ganesha`` + ``nfs-ganesha-vfs``), a process.
E2B mounts its volumes over NFS too.

Running the server inside the slot's namespace, bound to the gateway address the guest
already routes to (``TAP_IP``), gives isolation for free: a guest reaches only its own
namespace, whose server exports only the volumes its sandbox mounted; nothing is exposed on
the host. And it survives snapshots: a restored or forked guest keeps its NFS mount in
memory and its client reconnects to the same address, where its new slot's server now
answers (state is re-established; ``Graceless`` so nothing waits for a grace period). Many
sandboxes mount one volume at once, each through its own server, over the same host
directory — children of a fork see the volume itself, not a copy. Costs: one process of
~8 MiB per sandbox with volumes, started in ~0.1 s.

The server's files are under ``<AENV_HOME>/volume-servers/<netns>/`` (config, log, pid);
``stop`` runs whenever a slot is released, ``sweep`` after a crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..config import Settings
from . import volumes as host
from .errors import StorageError

log = logging.getLogger(__name__)

NFS_PORT = 2049
GANESHA = "ganesha.nfsd"
READY_MARK = "NFS SERVER INITIALIZED"
START_TIMEOUT_S = 10.0


class VolumeServerError(StorageError):
    """The NFS server of a sandbox's volumes could not be started."""


def servers_dir(settings: Settings) -> Path:
    return settings.home / "volume-servers"


def export_path(volume_id: str) -> str:
    """The NFSv4 pseudo path of a volume (what the guest mounts)."""
    return f"/{volume_id}"


def config(state: Path, exports: list[tuple[str, Path]]) -> str:
    """ganesha.conf for ``exports`` ([(volume id, host root)]): NFSv4.1+ over TCP only,
    no NLM/RQUOTA/portmapper, no grace period, attributes not cached (other sandboxes and
    the content API write the same directories)."""
    blocks = []
    for i, (volume_id, root) in enumerate(exports, start=1):
        blocks.append(f"""EXPORT {{
    Export_Id = {i};
    Path = "{root}";
    Pseudo = "{export_path(volume_id)}";
    Access_Type = RW;
    Squash = No_Root_Squash;
    SecType = sys;
    Protocols = 4;
    Transports = TCP;
    Attr_Expiration_Time = 0;
    FSAL {{ Name = VFS; }}
}}
""")
    return f"""NFS_CORE_PARAM {{
    Protocols = 4;
    NFS_Port = {NFS_PORT};
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}}
NFSV4 {{
    Graceless = true;
    Lease_Lifetime = 30;
    RecoveryBackend = fs;
    RecoveryRoot = "{state / 'recovery'}";
    Minor_Versions = 1, 2;
    Allow_Numeric_Owners = true;
    Only_Numeric_Owners = true;
}}
MDCACHE {{
    Dir_Chunk = 0;
}}
NFS_KRB5 {{ Active_krb5 = false; }}
{"".join(blocks)}"""


def _pid(state: Path) -> int | None:
    try:
        return int((state / "pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return GANESHA.encode() in f.read()
    except OSError:
        return False


def start(settings: Settings, netns: str, volume_ids: list[str]) -> int:
    """Start the server for ``volume_ids`` in ``netns`` (replacing one already there) and
    wait until it serves; returns its pid."""
    stop(settings, netns)
    state = servers_dir(settings) / netns
    (state / "recovery").mkdir(parents=True, exist_ok=True)
    exports = [(v, host.ensure_mounted(settings, v)) for v in volume_ids]
    conf = state / "ganesha.conf"
    conf.write_text(config(state, exports))
    logfile = state / "ganesha.log"
    logfile.write_bytes(b"")
    try:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, GANESHA, "-F", "-f", conf, "-L", logfile,
             "-p", state / "ganesha.pid", "-N", "NIV_EVENT"],
            cwd=state, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError as e:
        raise VolumeServerError("nfs-ganesha is not installed (scripts/setup.sh)") from e
    (state / "pid").write_text(str(proc.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-5:]
            stop(settings, netns)
            raise VolumeServerError(f"the volume NFS server exited: {' | '.join(tail)}")
        if READY_MARK in logfile.read_text(errors="replace"):
            return proc.pid
        time.sleep(0.02)
    stop(settings, netns)
    raise VolumeServerError("the volume NFS server did not start in time")


def stop(settings: Settings, netns: str) -> None:
    """End the server of ``netns``, if any, and remove its files."""
    state = servers_dir(settings) / netns
    if not state.exists():
        return
    pid = _pid(state)
    if pid is not None and _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.02)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _reap(pid)
    shutil.rmtree(state, ignore_errors=True)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def running(settings: Settings, netns: str) -> bool:
    pid = _pid(servers_dir(settings) / netns)
    return pid is not None and _alive(pid)


def sweep(settings: Settings) -> list[str]:
    """After a crash: end the servers whose namespace is gone (their slots were cleaned
    up); returns those namespaces."""
    base = servers_dir(settings)
    gone = []
    for d in sorted(base.iterdir()) if base.is_dir() else ():
        if not os.path.exists(f"/run/netns/{d.name}") or not running(settings, d.name):
            stop(settings, d.name)
            gone.append(d.name)
    return gone
