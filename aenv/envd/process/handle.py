"""One started process as envd tracks it: output readers, input, signals, lifetime, end.

Contract:
- ``ProcessHandle.start`` spawns the child and registers its output readers on the event
  loop; nothing is read before the caller's current synchronous step ends, so a subscription
  taken right after ``start`` (as Start does) sees every byte.
- Output is read in chunks (pipes 32 KiB, PTY 16 KiB) and handed to ``fanout``; reading
  pauses while the fan-out is blocked (see ``fanout.py`` for the buffering policy).
- The process *finishes* when the child has exited and either every output descriptor hit
  EOF or a SIGKILL/SIGTERM/deadline said not to wait for them (grandchildren that inherited
  the pipes would otherwise hold the end back). Only then is the child reaped, so the zombie
  keeps its pid from being reused while the handle is still registered; then descriptors are
  closed, the ``ExitStatus`` is appended after all output to every subscription, and
  ``finished`` resolves.
- A deadline (the Start request's Connect-Timeout-Ms) SIGKILLs the child when it passes.
Signals go to the child's pid only (through its pidfd, so never to a recycled pid).
Needs Linux >= 5.3 (pidfd). Single-threaded: call everything from the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable

from ..proto import process_pb
from .errors import InputRejected, ProcessError, StdinCloseFailed, UnsupportedSignal
from .exit import ExitStatus
from .fanout import OutputFanout
from .launch import LaunchSpec, Spawned, spawn
from .pty import set_window_size

PIPE_CHUNK = 32 << 10
PTY_CHUNK = 16 << 10
# After a kill, take at most this many reads per descriptor of output already written.
_DRAIN_READS = 4

log = logging.getLogger("aenv.envd.process")


class ProcessHandle:
    def __init__(self, spawned: Spawned, config: process_pb.ProcessConfig, tag: str | None,
                 deadline: float | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawned = spawned
        self.pid: int = spawned.pid
        self.config = config
        self.tag = tag
        self.is_pty = spawned.pty is not None
        self.status: ExitStatus | None = None
        self.finished: asyncio.Future[ExitStatus] = self._loop.create_future()
        self.fanout = OutputFanout(on_drain=self._resume_reading)

        self._started = time.monotonic()
        self._output_bytes = 0
        self._pty = spawned.pty
        self._stdin = spawned.stdin
        self._input_lock = asyncio.Lock()
        self._write_waits: dict[int, asyncio.Future[None]] = {}
        self._pumps: dict[int, tuple[str, int]] = {}
        if spawned.pty is not None:
            self._pumps[spawned.pty] = ("pty", PTY_CHUNK)
        else:
            assert spawned.stdout is not None and spawned.stderr is not None
            self._pumps[spawned.stdout] = ("stdout", PIPE_CHUNK)
            self._pumps[spawned.stderr] = ("stderr", PIPE_CHUNK)
        self._paused = False
        self._child_exited = False
        self._dont_wait_for_eof = False
        self._on_finish: list[Callable[[ProcessHandle], None]] = []

        self._pidfd = os.pidfd_open(self.pid)
        self._loop.add_reader(self._pidfd, self._on_child_exit)
        for fd in self._pumps:
            self._loop.add_reader(fd, self._on_readable, fd)
        # The timer may fire a little before loop.time() reaches ``deadline`` (uvloop's
        # timers have millisecond resolution), so the stream asks this, not the clock.
        self.killed_at_deadline = False
        self._deadline = (
            self._loop.call_at(deadline, self._on_deadline) if deadline is not None else None
        )

    @classmethod
    def start(cls, spec: LaunchSpec, config: process_pb.ProcessConfig, tag: str | None,
              deadline: float | None) -> ProcessHandle:
        """Spawn ``spec`` and track it. ``deadline`` is a ``loop.time()`` at which the child
        is killed, or None."""
        began = time.monotonic()
        spawned = spawn(spec)
        try:
            handle = cls(spawned, config, tag, deadline)
        except OSError as e:  # pidfd_open: out of descriptors
            _abandon(spawned)
            raise ProcessError(f"cannot track process {spawned.pid}: {e}") from e
        log.info("process started pid=%d user=%s pty=%s tag=%s spawn_ms=%.2f cmd=%r",
                 handle.pid, spec.user.name, handle.is_pty, tag,
                 (time.monotonic() - began) * 1000, spec.command)
        return handle

    def on_finish(self, callback: Callable[[ProcessHandle], None]) -> None:
        self._on_finish.append(callback)

    # --- signals -------------------------------------------------------------------------

    def signal(self, signum: int) -> None:
        """Send SIGKILL or SIGTERM to the child. Either also stops waiting for its output
        pipes to close: the stream ends as soon as the child itself is gone."""
        if signum not in (signal.SIGKILL, signal.SIGTERM):
            raise UnsupportedSignal(f"invalid signal: {signum}")
        if self.status is not None:
            return
        self._dont_wait_for_eof = True
        try:
            signal.pidfd_send_signal(self._pidfd, signum)
        except ProcessLookupError:
            pass  # already exited; the exit callback is on its way
        self._maybe_finish()

    async def wait_finished(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the process to be reaped."""
        try:
            await asyncio.wait_for(asyncio.shield(self.finished), timeout)
        except TimeoutError:
            pass

    def _on_deadline(self) -> None:
        self._deadline = None
        self.killed_at_deadline = True
        log.info("process deadline passed pid=%d, killing", self.pid)
        self.signal(signal.SIGKILL)

    # --- input ---------------------------------------------------------------------------

    async def write_stdin(self, data: bytes) -> None:
        if self.is_pty:
            raise InputRejected("error writing to stdin: tty assigned to process — input "
                                "should be written to the pty, not the stdin")
        async with self._input_lock:
            await self._write_all(lambda: self._stdin, data, "stdin",
                                  "stdin not enabled or closed")

    async def write_pty(self, data: bytes) -> None:
        if not self.is_pty:
            raise InputRejected("error writing to tty: tty not assigned to process — input "
                                "should be written to the stdin, not the tty")
        async with self._input_lock:
            await self._write_all(lambda: self._pty, data, "tty", "process has exited")

    def close_stdin(self) -> None:
        """EOF on stdin; a no-op when it is already closed or was never opened."""
        if self.is_pty:
            raise StdinCloseFailed("error closing stdin: cannot close stdin for PTY process "
                                   "— send Ctrl+D (0x04) instead")
        if self._stdin is not None:
            fd, self._stdin = self._stdin, None
            self._release_fd(fd)

    def resize(self, cols: int, rows: int) -> None:
        if self._pty is None:
            raise InputRejected("error resizing tty: tty not assigned to process")
        try:
            set_window_size(self._pty, cols, rows)
        except OSError as e:
            raise InputRejected(f"error resizing tty: {e.strerror}") from e

    async def _write_all(self, current_fd: Callable[[], int | None], data: bytes, what: str,
                         closed: str) -> None:
        view = memoryview(data)
        while view:
            fd = current_fd()
            if fd is None:
                raise InputRejected(f"error writing to {what}: {closed}")
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                await self._wait_writable(fd)
                continue
            except OSError as e:
                raise InputRejected(
                    f"error writing to {what} of process '{self.pid}': {e.strerror}") from e
            view = view[n:]

    async def _wait_writable(self, fd: int) -> None:
        waiter = self._loop.create_future()
        self._write_waits[fd] = waiter
        self._loop.add_writer(fd, _wake, waiter)
        try:
            await waiter
        finally:
            if self._write_waits.pop(fd, None) is not None:
                self._loop.remove_writer(fd)

    def _release_fd(self, fd: int) -> None:
        """Close an input descriptor, first waking any writer parked on it."""
        waiter = self._write_waits.pop(fd, None)
        if waiter is not None:
            self._loop.remove_writer(fd)
            _wake(waiter)
        os.close(fd)

    # --- output --------------------------------------------------------------------------

    def _on_readable(self, fd: int) -> None:
        kind, size = self._pumps[fd]
        try:
            data = os.read(fd, size)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # EIO: every slave end of the PTY is closed
        if not data:
            self._close_pump(fd)
            self._maybe_finish()
            return
        self._output_bytes += len(data)
        self.fanout.publish(kind, data)
        if self.fanout.blocked:
            self._pause_reading()

    def _pause_reading(self) -> None:
        if not self._paused:
            self._paused = True
            for fd in self._pumps:
                self._loop.remove_reader(fd)

    def _resume_reading(self) -> None:
        if self._paused and self.status is None:
            self._paused = False
            for fd in self._pumps:
                self._loop.add_reader(fd, self._on_readable, fd)

    def _drain(self) -> None:
        """Publish what the child wrote before it died (bounded: a grandchild may still be
        writing). Not while paused: the subscribers are full."""
        if self._paused:
            return
        for fd, (kind, size) in list(self._pumps.items()):
            for _ in range(_DRAIN_READS):
                try:
                    data = os.read(fd, size)
                except OSError:
                    break
                if not data:
                    break
                self._output_bytes += len(data)
                self.fanout.publish(kind, data)

    def _close_pump(self, fd: int) -> None:
        del self._pumps[fd]
        if not self._paused:
            self._loop.remove_reader(fd)
        if fd != self._pty:  # the PTY master also carries input; closed in _finish
            os.close(fd)

    # --- end -----------------------------------------------------------------------------

    def _on_child_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self._child_exited = True
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.status is not None or not self._child_exited:
            return
        if self._pumps and not self._dont_wait_for_eof:
            return
        self._finish()

    def _finish(self) -> None:
        self._drain()
        for fd in list(self._pumps):
            self._close_pump(fd)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        try:
            _, wstatus = os.waitpid(self.pid, 0)  # a zombie by now: returns at once
            self._spawned.reaped(wstatus)
            status = ExitStatus.from_wait_status(wstatus)
        except ChildProcessError:  # someone else in envd reaped it: say so, end anyway
            status = ExitStatus(-1, False, "unknown", "exit status lost: reaped elsewhere")
        os.close(self._pidfd)
        if self._stdin is not None:
            fd, self._stdin = self._stdin, None
            self._release_fd(fd)
        if self._pty is not None:
            fd, self._pty = self._pty, None
            self._release_fd(fd)

        self.status = status
        self.fanout.finish(status)
        self.finished.set_result(status)
        log.info("process ended pid=%d status=%r duration_ms=%.2f output_bytes=%d", self.pid,
                 status.status, (time.monotonic() - self._started) * 1000, self._output_bytes)
        for callback in self._on_finish:
            callback(self)


def _abandon(spawned: Spawned) -> None:
    """Kill and reap a child we cannot track, and close its descriptors."""
    os.kill(spawned.pid, signal.SIGKILL)
    spawned.reaped(os.waitpid(spawned.pid, 0)[1])
    for fd in (spawned.stdout, spawned.stderr, spawned.stdin, spawned.pty):
        if fd is not None:
            os.close(fd)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
