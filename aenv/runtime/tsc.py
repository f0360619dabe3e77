"""The host's TSC frequency, which a TCG guest must be told.

Under TCG the guest's ``rdtsc`` reads the host's TSC, so the guest kernel has to count the
host's ticks per second. It normally calibrates that against the emulated PIT, which fails
now and then on a loaded host (and the guest then hangs), so the qemu driver passes
``tsc_early_khz``. A fixed value is wrong on every other CPU: with 2596 MHz given on a
2793 MHz host the guest clock ran 7.6 % fast and drifted a second ahead within ~15 s.

The frequency is measured once per process: ``rdtsc`` against ``CLOCK_MONOTONIC`` (the
host's best idea of real seconds, NTP-disciplined where NTP runs) over a few short windows
(median), through a four-instruction function in an executable page.
Where that is impossible (not x86-64, no executable mapping) the kernel's figure from
``/proc/cpuinfo`` is used, which on a VM host with ``tsc_known_freq`` is the TSC rate.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("aenv.runtime")

# rdtsc; shl rdx, 32; or rax, rdx; ret
_RDTSC_X86_64 = bytes.fromhex("0f31" "48c1e220" "4809d0" "c3")
_WINDOW_S = 0.02
_WINDOWS = 5


def _rdtsc_function() -> tuple[Callable[[], int], mmap.mmap] | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return None
    page.write(_RDTSC_X86_64)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(ctypes.c_uint64)(address), page


def measure_khz() -> int | None:
    """TSC ticks per millisecond of ``CLOCK_MONOTONIC``, or None if rdtsc is out of
    reach. About 0.1 s."""
    found = _rdtsc_function()
    if found is None:
        return None
    rdtsc, page = found
    clock = time.CLOCK_MONOTONIC
    rates = []
    for _ in range(_WINDOWS):
        t0, c0 = time.clock_gettime_ns(clock), rdtsc()
        time.sleep(_WINDOW_S)
        c1, t1 = rdtsc(), time.clock_gettime_ns(clock)
        rates.append((c1 - c0) * 1_000_000 / (t1 - t0))
    del rdtsc
    page.close()
    return round(statistics.median(rates))


def cpuinfo_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int | None:
    """The first ``cpu MHz`` of ``/proc/cpuinfo`` in kHz, when that is the TSC's rate: the
    TSC is invariant and its frequency was given to the kernel (``tsc_known_freq``, as
    hypervisors do). Elsewhere the figure is the core's current clock."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
    if not flags or not mhz or not {"constant_tsc", "tsc_known_freq"} <= set(
            flags.group(1).split()):
        return None
    return round(float(mhz.group(1)) * 1000)


@functools.cache
def host_tsc_khz() -> int | None:
    """The host's TSC frequency in kHz (measured, else from cpuinfo), once per process."""
    khz = measure_khz()
    source = "measured"
    if khz is None:
        khz, source = cpuinfo_khz(), "/proc/cpuinfo"
    if khz:
        log.info("host TSC: %d kHz (%s)", khz, source)
    else:
        log.warning("host TSC frequency unknown: TCG guests calibrate it themselves")
    return khz
