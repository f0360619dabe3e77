"""An idle envd stays asleep: under emulation every wake-up of the guest costs host CPU."""

from __future__ import annotations

import os
import signal
import time
from email.utils import parsedate_to_datetime

import httpx
import pytest

from tests.conftest import Envd


def _wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_an_idle_envd_does_not_wake(envd_factory) -> None:
    envd: Envd = envd_factory()
    time.sleep(0.5)  # let start-up settle
    before = _wakeups(envd.proc.pid)
    time.sleep(3.0)
    woke = _wakeups(envd.proc.pid) - before
    # uvicorn's own serve loop wakes ten times a second (30 here); envd's not at all.
    print(f"idle envd: {woke} wake-ups in 3 s")
    assert woke <= 1, f"{woke} wake-ups in 3 s"


def test_responses_carry_the_current_date_without_a_timer(envd_factory) -> None:
    envd: Envd = envd_factory()
    first = httpx.get(f"{envd.url}/health").headers["date"]
    time.sleep(1.1)
    second = httpx.get(f"{envd.url}/health").headers["date"]
    assert second != first
    sent = parsedate_to_datetime(second).timestamp()
    assert abs(sent - time.time()) < 2


def test_sigterm_still_stops_envd_at_once(envd_factory) -> None:
    envd: Envd = envd_factory()
    t0 = time.monotonic()
    os.kill(envd.proc.pid, signal.SIGTERM)
    envd.proc.wait(10)
    assert time.monotonic() - t0 < 0.8  # not held until the next once-a-second tick
