"""One ``aenv server`` per home and per network-name prefix.

Crash recovery takes every VM, network slot and file under ``AENV_HOME``, and every host
object named with ``AENV_NAME_PREFIX`` (netns, veth, nft table), for its own: it adopts
them or removes them. A second server on the same home or prefix would do that to a live
server. So ``aenv server`` takes, before anything else touches the home, an exclusive
non-blocking ``flock`` on

- ``$AENV_HOME/server.lock``, and
- ``/run/aenv/prefix-<prefix>.lock`` — under ``/run`` like the netns mounts in
  ``/run/netns``, so the lock has their scope (the host, or the container aenv runs in),

and holds both until the process ends. Each file carries the holder's pid (and home) for
the error a second server prints (``InstanceTaken``). The kernel releases a lock when its
holder dies, ``kill -9`` included, so there is never a stale lock to remove; the
descriptors are close-on-exec, so VMMs the server spawns, which outlive it, do not inherit
them.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .config import Settings

RUN_DIR = Path("/run/aenv")


class InstanceTaken(Exception):
    """Another live server holds the home or the name prefix; the message says which and
    what to change."""


@dataclass
class InstanceLock:
    """The held locks; ``release`` (or the end of the process) lets the next server in."""

    paths: list[Path]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the only descriptor drops the flock
        self._fds.clear()


def _take(path: Path, note: str) -> int | str:
    """The locked descriptor with ``note`` written in, or what the holder wrote."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        return held
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    return fd


def _holder(note: str) -> tuple[str, str]:
    """(pid, home) from what a holder wrote: ``pid <n>\\nhome <path>``."""
    fields = dict(line.split(" ", 1) for line in note.splitlines() if " " in line)
    return fields.get("pid", "unknown"), fields.get("home", "unknown")


def claim_instance(settings: Settings, run_dir: Path = RUN_DIR) -> InstanceLock:
    """Lock ``settings``' home, then its name prefix, or raise ``InstanceTaken``."""
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    note = f"pid {os.getpid()}\nhome {home.resolve()}\n"
    lock = InstanceLock(paths=[])
    try:
        path = home / "server.lock"
        got = _take(path, note)
        if isinstance(got, str):
            raise InstanceTaken(
                f"another aenv server (pid {_holder(got)[0]}) uses AENV_HOME={home} "
                f"(it holds {path}); stop it first, or give this one its own AENV_HOME")
        lock._fds.append(got)
        lock.paths.append(path)
        run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        prefix = settings.name_prefix
        path = run_dir / f"prefix-{re.sub(r'[^A-Za-z0-9_-]', '_', prefix)}.lock"
        got = _take(path, note)
        if isinstance(got, str):
            pid, other = _holder(got)
            raise InstanceTaken(
                f"another aenv server (pid {pid}, AENV_HOME={other}) uses "
                f"AENV_NAME_PREFIX={prefix} for its network namespaces, veths and nft tables "
                f"(it holds {path}); give this one its own AENV_NAME_PREFIX, and its own "
                f"AENV_HOST_CIDR and AENV_VETH_CIDR")
        lock._fds.append(got)
        lock.paths.append(path)
    except BaseException:
        lock.release()
        raise
    return lock
