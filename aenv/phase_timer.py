"""``PhaseTimer``: where one operation's time went, phase by phase, with one clock reading
per mark. Neutral ground: the runtime's drivers (boot, restore, snapshot steps) and the
orchestrator (create, resume, fork) both time their phases with it, and the runtime may not
import the orchestrator. Prometheus and ``Server-Timing`` live in
``aenv.orchestrator.timing``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


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
