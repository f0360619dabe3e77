"""Pseudo-terminal helpers: open a pair with a window size, resize it, adopt it as the
controlling terminal of a new session.

A PTY process is started as a session leader (``setsid``) whose stdin, stdout and stderr are
the slave end, which must become its controlling terminal so job control, ``tput`` and
``SIGWINCH`` on resize behave as in a real terminal: either the child opens the slave by
path after ``setsid`` (what ``posix_spawn`` does in ``launch``), or, in the forking fallback,
``take_controlling_tty`` runs between ``fork`` and ``exec``. envd keeps only the master end.
"""

from __future__ import annotations

import fcntl
import os
import termios


def open_pty(cols: int, rows: int) -> tuple[int, int]:
    """A new (master, slave) pair sized ``cols`` x ``rows``; both close-on-exec, the master
    non-blocking."""
    master, slave = os.openpty()
    try:
        set_window_size(master, cols, rows)
        os.set_blocking(master, False)
    except OSError:
        os.close(master)
        os.close(slave)
        raise
    return master, slave


def set_window_size(fd: int, cols: int, rows: int) -> None:
    """TIOCSWINSZ; the kernel sends SIGWINCH to the terminal's foreground process group."""
    termios.tcsetwinsize(fd, (rows, cols))


def take_controlling_tty() -> None:
    """``preexec_fn`` for the child: make stdin (the slave) the session's controlling tty."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
