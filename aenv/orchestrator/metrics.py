"""Per-sandbox resource samples for ``GET /sandboxes/{id}/metrics``.

Every ``interval`` seconds the collector asks each running sandbox's envd for
``/metrics`` and keeps the last ``keep`` samples in memory (a restart starts the history
afresh; the SDK only asks for recent windows).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from datetime import UTC, datetime
from typing import Any

import httpx

from ..client.envd import ENVD_PORT, EnvdClient
from ..client.http import plain_client
from ..store import SandboxStore

log = logging.getLogger("aenv.metrics")


class MetricsCollector:
    def __init__(self, sandboxes: SandboxStore, interval: float = 5.0, keep: int = 720) -> None:
        self.sandboxes, self.interval, self.keep = sandboxes, interval, keep
        self._samples: dict[str, deque[dict[str, Any]]] = {}
        self._task: asyncio.Task | None = None
        self._http = plain_client(timeout=httpx.Timeout(3.0, connect=1.0))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="aenv-metrics")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._http.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.collect_once()

    async def collect_once(self) -> None:
        running = self.sandboxes.in_states(("running",))
        live = {r.id for r in running}
        for gone in set(self._samples) - live:
            if self.sandboxes.get(gone) is None:
                del self._samples[gone]
        await asyncio.gather(*(self._sample(r.id, r.host_ip, r.envd_token)
                               for r in running if r.host_ip))

    async def _sample(self, sandbox_id: str, host_ip: str, token: str | None) -> None:
        client = EnvdClient(f"http://{host_ip}:{ENVD_PORT}", token, client=self._http)
        try:
            m = await client.metrics()
        except (httpx.HTTPError, ValueError) as e:
            log.debug("sandbox %s: metrics unavailable: %s", sandbox_id, e)
            return
        ts = int(m.get("ts", 0))
        sample = {
            "timestamp": datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z"),
            "timestampUnix": ts,
            "cpuCount": int(m.get("cpu_count", 0)),
            "cpuUsedPct": float(m.get("cpu_used_pct", 0.0)),
            "memUsed": int(m.get("mem_used", 0)),
            "memTotal": int(m.get("mem_total", 0)),
            "memCache": int(m.get("mem_cache", 0)),
            "diskUsed": int(m.get("disk_used", 0)),
            "diskTotal": int(m.get("disk_total", 0)),
        }
        self._samples.setdefault(sandbox_id, deque(maxlen=self.keep)).append(sample)

    def samples(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return [s for s in self._samples.get(sandbox_id, ())
                if (start is None or s["timestampUnix"] >= start)
                and (end is None or s["timestampUnix"] <= end)]
