"""An interactive PTY session on a sandbox that feels like ssh.

``run_shell`` starts ``bash -i -l`` on a PTY in the sandbox sized like the local terminal,
puts the local terminal in raw mode, forwards every keystroke over one ``StreamInput``
client stream, writes the PTY's output to stdout untouched, follows window-size changes
(SIGWINCH → ``Update``), and restores the terminal however the session ends. Its result
is the shell's exit status (128 + signal when a signal ended it, as a local shell
reports).

Keystrokes go over StreamInput rather than one SendInput request each: a keystroke is
then one envelope on an already open request instead of a request through the proxy.
Keystroke-to-echo through the proxy on the shared 2-core host (noisy), 600 keys each
(``benchmarks/pty_input_latency.py --through-server``): StreamInput p50 0.6 ms / p99 9 ms,
SendInput p50 6.4 ms / p99 17 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import termios
import tty
from collections.abc import AsyncIterator, Iterator

from ..client.envd import EnvdClient, EnvdError, ProcessEvent, PtySize

DEFAULT_SIZE = PtySize(cols=80, rows=24)
_SIGNALS = {"hangup": 1, "interrupt": 2, "quit": 3, "killed": 9, "terminated": 15}
# How long to let the input stream finish cleanly once the shell has ended.
_INPUT_DRAIN_S = 1.0
_EOT = b"\x04"


def exit_status(end: ProcessEvent) -> int:
    """A process's end event as a shell exit status."""
    if end.exit_code >= 0 and (end.exited or end.exit_code > 0):
        return end.exit_code
    name = end.status.removeprefix("signal: ").strip()
    return 128 + _SIGNALS[name] if name in _SIGNALS else 255


def terminal_size(fd: int) -> PtySize:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return DEFAULT_SIZE
    return PtySize(cols=size.columns or DEFAULT_SIZE.cols, rows=size.lines or DEFAULT_SIZE.rows)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


async def _drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (chunk := await queue.get()) is not None:
        yield chunk


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Raw mode on a terminal ``fd`` for the block; the previous settings come back on
    any exit. A non-terminal ``fd`` is left alone."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_shell(envd: EnvdClient, *, user: str | None = None, cwd: str | None = None,
                    envs: dict[str, str] | None = None, stdin_fd: int = 0,
                    stdout_fd: int = 1) -> int:
    loop = asyncio.get_running_loop()
    term = os.environ.get("TERM") or "xterm-256color"
    # The SDK's PTY defaults; the caller's variables win.
    env = {"TERM": term, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **(envs or {})}
    resize_follows = os.isatty(stdout_fd)
    events = envd.start("/bin/bash", ["-i", "-l"], user=user, cwd=cwd, envs=env,
                        pty=terminal_size(stdout_fd), stdin=None, timeout=None)
    async with contextlib.aclosing(events):
        first = await anext(events)
        if first.kind != "start":
            raise EnvdError("the shell's stream did not open with a start event")
        pid = first.pid
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()

        def on_input() -> None:
            data = os.read(stdin_fd, 65536)
            if data:
                queue.put_nowait(data)
                return
            # Local EOF (piped input ran out): a terminal user would type ^D.
            loop.remove_reader(stdin_fd)
            queue.put_nowait(_EOT)

        def on_resize() -> None:
            task = loop.create_task(envd.resize(pid, terminal_size(stdout_fd)))
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def show_output() -> int:
            async for event in events:
                if event.kind in ("pty", "stdout", "stderr"):
                    _write_all(stdout_fd, event.data)
                elif event.kind == "end":
                    return exit_status(event)
            raise EnvdError("the shell's stream ended without an end event")

        with raw_mode(stdin_fd):
            loop.add_reader(stdin_fd, on_input)
            if resize_follows:
                loop.add_signal_handler(signal.SIGWINCH, on_resize)
            output = loop.create_task(show_output())
            forward = loop.create_task(envd.stream_input(pid, _drain(queue), pty=True))
            try:
                await asyncio.wait({output, forward}, return_when=asyncio.FIRST_COMPLETED)
                if not output.done():
                    forward.result()  # the input stream failed: raise its error
                return await output
            finally:
                loop.remove_reader(stdin_fd)
                if resize_follows:
                    loop.remove_signal_handler(signal.SIGWINCH)
                output.cancel()
                queue.put_nowait(None)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(forward, _INPUT_DRAIN_S)
                for task in pending:
                    task.cancel()
