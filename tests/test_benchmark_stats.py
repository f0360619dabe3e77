"""benchmarks/_common.py's figures say what they are: every summary has its sample count, a
p50 of an even count is the middle two's mean (not the lower one), a p99 of fewer than 100
samples is refused rather than printed as the maximum, and a Server-Timing phase a row does
not name is left out instead of counted as 0 ms."""

from __future__ import annotations

import httpx
import pytest

from benchmarks._common import P99_MIN_N, expect_status, percentile, phase_summaries, summary, tail


def test_p50_of_two_is_their_mean_not_their_minimum() -> None:
    assert summary([10.0, 30.0])["p50"] == 20.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0


def test_p99_needs_a_hundred_samples() -> None:
    few = summary([float(i) for i in range(P99_MIN_N - 1)])
    assert few["n"] == P99_MIN_N - 1 and few["p99"] is None and tail(few) is None
    assert few["p99_needs_n"] == P99_MIN_N and few["max"] == P99_MIN_N - 2
    many = summary([float(i) for i in range(1, 201)])
    assert many["n"] == 200 and many["p99"] == pytest.approx(198.01) and "p99_needs_n" not in many
    assert summary([]) == {"n": 0}


def test_a_missing_phase_is_not_zero() -> None:
    rows = [{"slot": 2.0, "disk": 4.0}, {"slot": 6.0}]
    out = phase_summaries(rows, ("slot", "disk", "vmm"))
    assert out["slot"]["n"] == 2 and out["slot"]["p50"] == 4.0
    assert out["disk"]["n"] == 1 and out["disk"]["p50"] == 4.0  # not (0 + 4) / 2
    assert out["vmm"] == {"n": 0}


def test_an_unexpected_status_stops_the_benchmark() -> None:
    ok = httpx.Response(204, request=httpx.Request("GET", "http://x/health"))
    assert expect_status(ok, 204) is ok
    bad = httpx.Response(502, text="no route", request=httpx.Request("GET", "http://x/health"))
    with pytest.raises(RuntimeError, match="502"):
        expect_status(bad, 204)
