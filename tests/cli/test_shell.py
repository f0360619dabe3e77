"""``aenv sandbox shell`` under a real pseudo-terminal, as a person at a terminal uses it.

The CLI runs as its own process with a fresh PTY as its controlling terminal; the test
holds both ends, so it can type, read what the screen would show, and look at the
terminal's settings while the shell runs and after it ends.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ROOT, stop_process

PROMPT = b"$ "


class Terminal:
    """A PTY with ``aenv sandbox shell ID`` attached to its slave side."""

    def __init__(self, sandbox_id: str, env: dict[str, str], cols: int, rows: int) -> None:
        self.master, self.slave = os.openpty()
        self.resize(cols, rows)
        self.settings_before = termios.tcgetattr(self.slave)
        self.screen = b""

        def controlling_tty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from aenv.cli.main import app; app()",
             "sandbox", "shell", sandbox_id],
            stdin=self.slave, stdout=self.slave, stderr=self.slave, cwd=ROOT,
            env={**os.environ, **env, "TERM": "xterm"}, preexec_fn=controlling_tty)

    def resize(self, cols: int, rows: int) -> None:
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: bytes, timeout: float = 15.0) -> None:
        start = len(self.screen)
        deadline = time.monotonic() + timeout
        while pattern not in self.screen[start:]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; screen: {self.screen[-500:]!r}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.2))
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:  # the slave side closed
                    continue

    def settings(self) -> list:
        return termios.tcgetattr(self.slave)

    def wait(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, grace=2)  # setsid made it a group leader
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def terminal(sandbox_id: str, cli_env: dict[str, str]) -> Iterator[Terminal]:
    t = Terminal(sandbox_id, cli_env, cols=100, rows=30)
    try:
        yield t
    finally:
        t.close()


def is_raw(settings: list) -> bool:
    lflag = settings[3]
    return not lflag & (termios.ICANON | termios.ECHO | termios.ISIG)


def test_shell_runs_commands_and_restores_the_terminal(terminal: Terminal) -> None:
    terminal.expect(PROMPT)
    assert is_raw(terminal.settings())
    terminal.type("echo $((6*7))\r")
    terminal.expect(b"42\r\n")
    terminal.type("exit\r")
    assert terminal.wait() == 0
    assert terminal.settings() == terminal.settings_before
    assert not is_raw(terminal.settings())


def test_shell_exits_with_the_shells_status(terminal: Terminal) -> None:
    terminal.expect(PROMPT)
    terminal.type("exit 7\r")
    assert terminal.wait() == 7


@pytest.mark.slow
def test_shell_has_the_local_window_size_and_follows_changes(terminal: Terminal) -> None:
    terminal.expect(PROMPT)
    terminal.type("stty size\r")
    terminal.expect(b"30 100\r\n")
    terminal.resize(120, 40)
    os.kill(terminal.proc.pid, signal.SIGWINCH)
    # The resize is asynchronous: ask until the new size shows (bounded by expect).
    deadline = time.monotonic() + 10
    while True:
        terminal.type("stty size\r")
        try:
            terminal.expect(b"40 120\r\n", timeout=1)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
    terminal.type("exit\r")
    assert terminal.wait() == 0


def test_ctrl_c_reaches_the_sandbox_not_the_cli(terminal: Terminal) -> None:
    terminal.expect(PROMPT)
    terminal.type("sleep 30\r")
    time.sleep(0.5)
    terminal.type("\x03")
    terminal.expect(PROMPT)
    assert terminal.proc.poll() is None
    terminal.type("echo status=$?\r")
    terminal.expect(b"status=130")
    terminal.type("exit 0\r")
    assert terminal.wait() == 0


@pytest.mark.slow
def test_terminal_is_restored_when_the_sandbox_goes_away(terminal: Terminal, server,
                                                         sandbox_id: str) -> None:
    terminal.expect(PROMPT)
    assert is_raw(terminal.settings())
    r = httpx.delete(f"{server.url}/sandboxes/{sandbox_id}",
                     headers={"X-API-KEY": server.server.api_key}, timeout=30)
    assert r.status_code == 204
    assert terminal.wait() == 255
    assert terminal.settings() == terminal.settings_before
    terminal.expect(b"error:")
