"""Where lifecycle time goes: per-phase durations, measured by ``PhaseTimer`` and kept as
Prometheus histograms.

Phases of a create: ``orchestrator`` (checks, store writes), then what the machines report
(``slot``, ``disk``, ``prepare``, ``vmm``, ``kernel``, ``init``, ``envd``, ``envd_init``).
The API adds ``api`` and returns all of them in a ``Server-Timing`` header; resume, connect
and fork answers carry their phases the same way (``parse_server_timing`` reads them back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from prometheus_client import Histogram

PHASE_SECONDS = Histogram(
    "aenv_sandbox_phase_seconds", "Duration of one phase of a sandbox operation",
    ["operation", "phase"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
             30, 60),
)


class PhaseTimer:
    """Seconds per named phase of one operation, in the order the phases ran.

    ``mark(name)`` ends the phase that ran since the previous mark (or since the timer was
    made) and starts the next; ``skip`` starts the next without naming what ran meanwhile;
    ``add`` records phases someone else measured (a boot's own breakdown, the machines'
    share of a create) without moving the mark; ``remainder(name)`` names what the whole took
    beyond every phase recorded so far. ``phases`` is what ``record_phases`` and
    ``server_timing`` take. Each of ``__init__``, ``mark``, ``skip``, ``elapsed`` and
    ``remainder`` reads the clock once.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = self._last = clock()
        self.phases: dict[str, float] = {}

    def mark(self, phase: str, *, excluding: float = 0.0) -> float:
        """End ``phase`` now; ``excluding`` is the part of it that phases added next account
        for. Returns the clock's reading."""
        now = self._clock()
        self.phases[phase] = now - self._last - excluding
        self._last = now
        return now

    def skip(self) -> None:
        """Start the next phase now: what ran since the last mark is no phase."""
        self._last = self._clock()

    def add(self, phases: Mapping[str, float]) -> None:
        self.phases.update(phases)

    def elapsed(self) -> float:
        """Seconds since the timer was made."""
        return self._clock() - self.started

    def remainder(self, phase: str) -> float:
        """Record ``phase`` as the time since the start that no recorded phase holds."""
        self.phases[phase] = value = self.elapsed() - sum(self.phases.values())
        return value

    def summary(self) -> str:
        """``slot=12ms disk=3ms ...``, for a log line."""
        return " ".join(f"{k}={v * 1000:.0f}ms" for k, v in self.phases.items())


def record_phases(operation: str, phases: Mapping[str, float]) -> None:
    for phase, seconds in phases.items():
        PHASE_SECONDS.labels(operation, phase).observe(max(seconds, 0.0))


def server_timing(phases: Mapping[str, float]) -> str:
    """``Server-Timing`` header value (milliseconds, as the header wants)."""
    return ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in phases.items())


def parse_server_timing(header: str) -> dict[str, float]:
    """``api;dur=1.2, slot;dur=0.3`` -> ``{"api": 1.2, "slot": 0.3}`` (milliseconds)."""
    phases: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key == "dur":
                phases[name] = float(value)
    return phases
