"""One VMM process seen from the server: spawn it detached, adopt it again, wait, end it.

``spawn`` starts the argv with cwd = the VM working directory, stdin from /dev/null and
stdout/stderr appended to a log file there, in a new session (so its own process group):
the VMM outlives the server and signals sent to the server's group never reach it. The pid
is pinned with a pidfd at once, so waiting and the liveness check never race a pid reuse,
and ``adopt`` (after a server restart) pins the pid first and only then checks that its
cwd is the working directory, so a recycled pid is never mistaken for the VMM.

``terminate`` sends SIGTERM to the process group, then SIGKILL after a grace period.
VMM-neutral: both drivers hold their VMM through it (``QemuVM`` asks QMP to quit first and
keeps its own ladder of signals, each wait bounded; ``FirecrackerVM`` terminates).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path


def _resolve(future: asyncio.Future[None]) -> None:
    """Complete ``future`` unless it is already done (a reader may fire twice)."""
    if not future.done():
        future.set_result(None)


class NotOurProcessError(Exception):
    """The pid is gone, or its cwd is not the working directory it should run in."""


class VMMProcess:
    """A live (or exited) VMM process; ``close`` releases the pidfd once it is reaped."""

    def __init__(self, pid: int, *, pidfd: int,
                 popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._popen = popen
        self._returncode: int | None = None

    @classmethod
    def spawn(cls, argv: list[str], cwd: Path, log_path: Path,
              pass_fds: tuple[int, ...] = (), env: Mapping[str, str] | None = None
              ) -> VMMProcess:
        """Start ``argv`` detached (blocking: call it from a worker thread in async code).
        ``pass_fds`` keep their numbers in the VMM; ``env`` is added to the server's
        environment."""
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     pass_fds=pass_fds,
                                     env={**os.environ, **env} if env else None)
        return cls(popen.pid, pidfd=os.pidfd_open(popen.pid), popen=popen)

    @classmethod
    def adopt(cls, pid: int, workdir: Path, *, jail_root: Path | None = None) -> VMMProcess:
        """Take over a VMM started by an earlier server process. ``jail_root``: the VMM was
        pivoted into that directory (the Firecracker jailer), so its cwd has no name the
        host can read; it must be that very directory (same device and inode)."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            raise NotOurProcessError(f"pid {pid} is gone") from e
        try:
            if jail_root is not None:
                cwd = os.stat(f"/proc/{pid}/cwd")
                want = os.stat(jail_root)
                ours = (cwd.st_dev, cwd.st_ino) == (want.st_dev, want.st_ino)
                where = f"a directory other than its jail {jail_root}"
            else:
                where = os.readlink(f"/proc/{pid}/cwd")
                ours = Path(where) == workdir.resolve()
        except OSError as e:
            os.close(pidfd)
            raise NotOurProcessError(f"pid {pid} is gone") from e
        if not ours:
            os.close(pidfd)
            raise NotOurProcessError(f"pid {pid} runs in {where}, not {workdir}")
        return cls(pid, pidfd=pidfd)

    @property
    def is_child(self) -> bool:
        return self._popen is not None

    @property
    def returncode(self) -> int | None:
        """The exit status of a child that has exited; None while it runs, and always for
        an adopted VMM (its parent reaps it)."""
        return self._popen.poll() if self._popen is not None else self._returncode

    def is_alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        if self._pidfd < 0:
            return False
        # a pidfd polls readable once its process has exited
        return not select.select([self._pidfd], [], [], 0)[0]

    async def wait(self) -> int | None:
        """Wait for the exit; its status when it is our child, else None."""
        if self.is_alive():
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self._pidfd, _resolve, exited)
            try:
                await exited
            finally:
                loop.remove_reader(self._pidfd)
        if self._popen is not None:
            self._returncode = self._popen.wait()
        return self._returncode

    def signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    async def terminate(self, timeout: float) -> None:
        """SIGTERM the process group; SIGKILL it if the VMM is still there after ``timeout``."""
        if self.is_alive():
            self.signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), timeout)
                return
            except TimeoutError:
                self.signal_group(signal.SIGKILL)
        await self.wait()

    def kill_now(self) -> None:
        """SIGKILL the group and reap it (blocking; for cleanup after a failed start)."""
        self.signal_group(signal.SIGKILL)
        if self._popen is not None:
            self._popen.wait()
        self.close()

    def close(self) -> None:
        """Release the pidfd once the VMM has exited (a live one stays pinned)."""
        if self._pidfd >= 0 and not self.is_alive():
            os.close(self._pidfd)
            self._pidfd = -1

    def abandon(self) -> None:
        """Stop watching a VMM that is not taken over after all (an attach that failed
        once the pid was pinned): the pidfd is closed, the process runs on."""
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
