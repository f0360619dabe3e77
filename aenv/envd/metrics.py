"""Guest resource usage for ``GET /metrics``, read from /proc and statvfs.

CPU use is the busy share of all CPUs between two calls (the orchestrator polls), so the
first sample after start reports the average since boot.
"""

from __future__ import annotations

import os
import time


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields), idle


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


class MetricsSampler:
    def __init__(self) -> None:
        self._last = (0, 0)

    def sample(self) -> dict[str, float | int]:
        total, idle = _cpu_times()
        d_total, d_idle = total - self._last[0], idle - self._last[1]
        self._last = (total, idle)
        cpu_pct = 100.0 * (d_total - d_idle) / d_total if d_total > 0 else 0.0
        mem = _meminfo()
        mem_total = mem.get("MemTotal", 0)
        mem_used = mem_total - mem.get("MemAvailable", mem.get("MemFree", 0))
        disk = os.statvfs("/")
        disk_total = disk.f_blocks * disk.f_frsize
        disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": round(cpu_pct, 2),
            "mem_total": mem_total,
            "mem_used": mem_used,
            "mem_cache": mem.get("Cached", 0),
            "mem_total_mib": mem_total // (1024 * 1024),
            "mem_used_mib": mem_used // (1024 * 1024),
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
