"""Guest resource usage for ``GET /metrics``, read from /proc and statvfs.

CPU use is the busy share of all CPUs between two calls (the orchestrator polls), so the
first sample after start reports the average since boot.

The orchestrator asks every running sandbox that works (an idle one rarely:
``aenv.orchestrator.metrics``), and under emulation each answer's Python is paid in the
VMM's host CPU, so ``MetricsEndpoint`` answers as a bare ASGI app: no routing, request
object or response class (``aenv.envd.app`` sends ``GET /metrics`` to it past Starlette,
after the access-token check), and ``/proc/meminfo`` is read only as far as the fields it
reports.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

# /proc/meminfo fields reported; they are among its first lines.
_MEMINFO_FIELDS = frozenset({b"MemTotal", b"MemFree", b"MemAvailable", b"Cached"})


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields), idle


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            if key in _MEMINFO_FIELDS:
                out[key.decode()] = int(rest.split()[0]) * 1024
                if len(out) == len(_MEMINFO_FIELDS):
                    break
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


class MetricsEndpoint:
    """``GET /metrics``: one sample as JSON, straight over ASGI."""

    def __init__(self, sampler: MetricsSampler) -> None:
        self.sampler = sampler

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.dumps(self.sampler.sample(), separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
