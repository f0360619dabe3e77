"""The host TSC frequency given to TCG guests."""

from __future__ import annotations

import platform

import pytest

from aenv.runtime import tsc

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor @ 2.80GHz
cpu MHz\t\t: 2793.436
flags\t\t: fpu tsc msr constant_tsc nonstop_tsc tsc_known_freq
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="rdtsc is x86-64")
def test_the_measurement_agrees_with_the_kernels_figure() -> None:
    measured = tsc.measure_khz()
    assert measured is not None
    kernel = tsc.cpuinfo_khz()
    if kernel is None:
        pytest.skip("/proc/cpuinfo does not give the TSC's rate here")
    # With tsc_known_freq, cpu MHz is the rate the kernel was given: well within 2 %.
    assert abs(measured - kernel) / kernel < 0.02, (measured, kernel)


def test_cpuinfo_gives_the_rate_only_for_an_invariant_tsc_of_known_rate(tmp_path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    assert tsc.cpuinfo_khz(f) == 2793436
    for flag in (" constant_tsc", " tsc_known_freq"):
        f.write_text(CPUINFO.replace(flag, ""))
        assert tsc.cpuinfo_khz(f) is None
    assert tsc.cpuinfo_khz(tmp_path / "missing") is None
