"""How a process ended, in the words upstream envd uses on the wire.

Upstream envd is Go and fills ``EndEvent`` from ``os.ProcessState``: ``exit status 3`` for an
exit, ``signal: killed`` for a signal (Go's signal names are glibc's ``strsignal`` text with a
lower-case first letter), ``exitCode`` -1 when signalled, and an ``error`` equal to the status
whenever the process did not exit 0. SDKs raise ``CommandExitException`` from these fields.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class ExitStatus:
    exit_code: int
    exited: bool
    status: str
    error: str | None

    @classmethod
    def from_wait_status(cls, wstatus: int) -> ExitStatus:
        """Decode a raw ``waitpid`` status."""
        if os.WIFEXITED(wstatus):
            code = os.WEXITSTATUS(wstatus)
            status = f"exit status {code}"
            return cls(code, True, status, None if code == 0 else status)
        if os.WIFSIGNALED(wstatus):
            status = "signal: " + signal_name(os.WTERMSIG(wstatus))
            if os.WCOREDUMP(wstatus):
                status += " (core dumped)"
            return cls(-1, False, status, status)
        # Stopped/continued statuses never reach us: we wait without WUNTRACED.
        status = f"wait status {wstatus:#x}"
        return cls(-1, False, status, status)


def signal_name(signum: int) -> str:
    """Go's name for a signal: ``killed``, ``terminated``, ``segmentation fault``; numbered
    beyond the classic 31, as Go does for real-time signals."""
    text = signal.strsignal(signum) if 0 < signum < 32 else None
    if not text or text.startswith("Unknown signal"):
        return f"signal {signum}"
    return text[0].lower() + text[1:]
