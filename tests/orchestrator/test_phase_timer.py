"""``PhaseTimer``: the phases of one operation, named as they end, in the order they ran."""

from __future__ import annotations

import pytest

from aenv.orchestrator.timing import PhaseTimer


class Clock:
    """Reads 0, then whatever ``at`` set; counts the reads."""

    def __init__(self) -> None:
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def at(self, t: float) -> None:
        self.now = t


def test_each_mark_ends_the_phase_since_the_previous_one() -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    clock.at(0.5)
    timer.mark("slot")
    clock.at(2.0)
    assert timer.mark("restore") == 2.0
    assert timer.phases == {"slot": 0.5, "restore": 1.5}
    assert list(timer.phases) == ["slot", "restore"]


def test_a_skipped_span_is_no_phase() -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    clock.at(1.0)
    timer.mark("capture")
    clock.at(1.25)
    timer.skip()
    clock.at(4.25)
    timer.mark("children")
    assert timer.phases == {"capture": 1.0, "children": 3.0}


def test_phases_measured_elsewhere_follow_the_span_they_were_part_of() -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    clock.at(5.0)
    timer.mark("prepare", excluding=3.0)  # a boot of 3 s, split by the console's markers
    timer.add({"vmm": 1.0, "kernel": 2.0})
    clock.at(5.5)
    timer.mark("envd_init")
    assert timer.phases == {"prepare": 2.0, "vmm": 1.0, "kernel": 2.0, "envd_init": 0.5}


def test_the_remainder_is_what_no_recorded_phase_holds() -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    timer.add({"slot": 0.25, "restore": 0.5})
    clock.at(1.0)
    assert timer.remainder("orchestrator") == pytest.approx(0.25)
    assert list(timer.phases) == ["slot", "restore", "orchestrator"]
    assert timer.elapsed() == 1.0


def test_every_reading_call_reads_the_clock_once() -> None:
    clock = Clock()
    timer = PhaseTimer(clock)
    timer.mark("a")
    timer.skip()
    timer.elapsed()
    timer.remainder("b")
    timer.add({"c": 1.0})
    timer.summary()
    assert clock.reads == 5


def test_the_summary_shows_milliseconds_for_a_log_line() -> None:
    timer = PhaseTimer(Clock())
    timer.add({"slot": 0.0123, "disk": 0.0031})
    assert timer.summary() == "slot=12ms disk=3ms"
