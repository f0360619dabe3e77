"""Per-sandbox resource samples for ``GET /sandboxes/{id}/metrics``.

Every ``interval`` seconds the collector samples each running sandbox and keeps the last
``keep`` samples in memory (a restart starts the history afresh; the SDK only asks for
recent windows). A sample is envd's ``/metrics`` answer, or, for a guest that did nothing,
a repeat of its last one (``_repeat``): asking wakes the guest (TCP, envd's Python), 13-20
ms of its VMM's host CPU per call under TCG (more the first time, when the code is
translated), and an idle sandbox asked every 30 s cost the host ~2.0-2.2 ms/s, ~1.2-1.6
without (benchmarks/density.py --n 20).

Whether the guest did anything is read on the host, without asking it: its VMM
(``vm_pid``, ``/proc/PID/stat``) used less than ``IDLE_CPU_MS_PER_S`` of host CPU per
second since the previous round. Such a round repeats the last answer with the host's
timestamp and ``cpuUsedPct`` from the VMM's own CPU time over the round (its share of the
guest's vCPUs: an upper bound of the guest's use, as emulation and device threads count
too); memory and disk are the last answer's, which nothing ran to change. The first
answer after repeats takes its ``cpuUsedPct`` the same way (envd's covers every second
since it was last asked). A sandbox with no answer yet, no known VMM, a VMM that worked,
a failed last answer, or whose last answer is ``REFRESH_S`` old is asked.

While a fork's children start (``hold``: the node's ``SlotPool.fanning_out``, the signal
that holds the slot pool's refill too) no guest is asked: the children already running
would each answer with a cold envd (tens of ms of their VMM's CPU under TCG) on the two
cores their siblings need to come up. Such a round only repeats idle guests' answers (read
on the host) and takes no sample of the others; after ``HOLD_MAX_S`` of holding one round
asks as usual, so fan-outs back to back cannot starve the history.

A guest's root can answer anything, so nothing it sends is trusted. Each call is bounded
by ``SAMPLE_TIMEOUT_S`` and by ``EnvdClient``'s ``METRICS_MAX_BYTES``; the answer must be
a JSON object whose fields have their type, are finite and lie in range (``_parse``:
counts and byte sizes are non-negative integers up to ``MAX_VALUE``, CPU use a percentage,
the timestamp between 2000 and 2100, used never above total), else the whole sample is
dropped. Sandboxes are sampled independently: a bad one loses its own sample and is
logged (a warning when it starts failing, debug while it goes on), the others are
collected as usual, and the loop outlives every error but its own cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from ..client.envd import EnvdClient, EnvdError
from ..client.http import plain_client
from ..envd import ENVD_PORT
from ..store import SandboxState, SandboxStore

log = logging.getLogger("aenv.metrics")

# One guest's whole /metrics call (connect, answer, body); below the default 5 s interval
# so a round ends before the next begins, and ample for envd, which answers in ms.
SAMPLE_TIMEOUT_S = 3.0
# Counts and byte sizes: 2**53 bytes is 8 PiB, beyond any guest, and the largest integer a
# JavaScript SDK reads exactly.
MAX_VALUE = 2 ** 53
# Seconds since the epoch: 2000-01-01 to 2100-01-01. A guest clock outside is wrong, and
# far enough outside it would not convert to a date at all.
TS_RANGE = (946_684_800, 4_102_444_800)
# Below this much host CPU per second of wall time (all its threads), a VMM's guest counts
# as idle: an idle TCG guest costs ~1-5 ms/s (one /metrics call 13-20 ms, so a guest asked
# every 5 s stays below too), one that runs anything 100 and more.
IDLE_CPU_MS_PER_S = 30.0
# An idle guest is asked at least this often (seconds), so what slow changes below the
# threshold add up to shows within minutes; ~0.15 ms/s of an idle VMM's host CPU.
REFRESH_S = 300.0
# Rounds are held (no guest asked) while a fan-out runs, for at most this long in a row
# (seconds): a fork x16 under TCG takes ~10 s.
HOLD_MAX_S = 60.0
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def vmm_cpu_s(pid: int) -> float | None:
    """Host CPU seconds (user + system, every thread) process ``pid`` has used; None when
    it cannot be read (gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # fields 14, 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


class BadSample(ValueError):
    """A guest's /metrics answer that is not a sample."""


def _shown(value: Any) -> str:
    return repr(value)[:40]


def _integer(m: dict[str, Any], key: str, default: int, high: int = MAX_VALUE) -> int:
    value = m.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise BadSample(f"{key} is {_shown(value)}, not an integer in [0, {high}]")
    return value


def _stamp(ts: int) -> dict[str, Any]:
    return {"timestamp": datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z"),
            "timestampUnix": ts}


def _vmm_pct(busy_ms_per_s: float, cpu_count: int) -> float:
    """A guest's CPU use in percent of its vCPUs, from its VMM's host CPU ms per second."""
    return round(min(busy_ms_per_s / 10 / max(cpu_count, 1), 100.0), 2)


def _parse(m: Any) -> dict[str, Any]:
    """The API's sample from envd's answer; ``BadSample`` unless every field is sane. A
    missing field counts as 0, except the timestamp, which is then the host's clock."""
    if not isinstance(m, dict):
        raise BadSample(f"the answer is {type(m).__name__}, not a JSON object")
    ts = m.get("ts", int(time.time()))
    if isinstance(ts, bool) or not isinstance(ts, int) or not TS_RANGE[0] <= ts < TS_RANGE[1]:
        raise BadSample(f"ts is {_shown(ts)}, not a time between 2000 and 2100")
    cpu = m.get("cpu_used_pct", 0.0)
    if (isinstance(cpu, bool) or not isinstance(cpu, int | float) or not math.isfinite(cpu)
            or not 0 <= cpu <= 100):
        raise BadSample(f"cpu_used_pct is {_shown(cpu)}, not a percentage")
    sample: dict[str, Any] = {
        **_stamp(ts),
        "cpuCount": _integer(m, "cpu_count", 0, high=4096),
        "cpuUsedPct": float(cpu),
        "memUsed": _integer(m, "mem_used", 0),
        "memTotal": _integer(m, "mem_total", 0),
        "memCache": _integer(m, "mem_cache", 0),
        "diskUsed": _integer(m, "disk_used", 0),
        "diskTotal": _integer(m, "disk_total", 0),
    }
    for part, total in (("memUsed", "memTotal"), ("memCache", "memTotal"),
                        ("diskUsed", "diskTotal")):
        if sample[part] > sample[total]:
            raise BadSample(f"{part} {sample[part]} is above {total} {sample[total]}")
    return sample


class MetricsCollector:
    def __init__(self, sandboxes: SandboxStore, interval: float = 5.0, keep: int = 720,
                 clock: Callable[[], float] = time.monotonic,
                 hold: Callable[[], bool] | None = None) -> None:
        self.sandboxes, self.interval, self.keep, self.clock = sandboxes, interval, keep, clock
        self.hold = hold  # whether a fan-out is starting on the node now (module doc)
        self._held_since: float | None = None
        self._samples: dict[str, deque[dict[str, Any]]] = {}
        self._failing: set[str] = set()  # sandboxes whose last sample failed (and logged)
        # sandbox -> (VMM pid, its CPU seconds, clock) at the previous round
        self._cpu: dict[str, tuple[int, float, float]] = {}
        self._asked: dict[str, float] = {}  # sandbox -> clock of its last good answer
        self._repeated: set[str] = set()  # sandboxes whose last sample is a repeat
        self._task: asyncio.Task[None] | None = None
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
        broken = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.collect_once()
                broken = False
            except Exception:
                if not broken:
                    log.exception("metrics: a collection round failed; trying again every "
                                  "%gs", self.interval)
                broken = True

    async def collect_once(self) -> None:
        """Sample every running sandbox once: idle ones from their last answer, the others
        by asking, concurrently; each call is bounded by ``SAMPLE_TIMEOUT_S`` and none can
        fail the round. While a fan-out holds the round (``_held``) nobody is asked."""
        running = self.sandboxes.in_states((SandboxState.RUNNING,))
        live = {r.id for r in running}
        for gone in set(self._samples) - live:
            if self.sandboxes.get(gone) is None:
                del self._samples[gone]
        self._failing &= live
        self._repeated &= live
        for gone in set(self._cpu) - live:
            del self._cpu[gone]
        for gone in set(self._asked) - live:
            del self._asked[gone]
        held = self._held()
        asks = []
        for r in running:
            if not r.host_ip:
                continue
            busy = self._vmm_busy(r.id, r.vm_pid)
            if busy is not None and self._may_repeat(r.id, busy):
                self._repeat(r.id, busy)
            elif held:
                continue  # asked at the first round after the fan-out
            else:
                after_repeats = busy if r.id in self._repeated else None
                asks.append(self._sample(r.id, r.host_ip, r.envd_token, after_repeats))
        await asyncio.gather(*asks)

    def _held(self) -> bool:
        """Whether this round asks nobody: a fan-out is starting (``hold``). After
        ``HOLD_MAX_S`` of held rounds one round asks as usual, then holding starts again."""
        if self.hold is None or not self.hold():
            self._held_since = None
            return False
        now = self.clock()
        if self._held_since is None:
            self._held_since = now
            log.debug("metrics: a fan-out is starting; guests are not asked meanwhile")
        if now - self._held_since >= HOLD_MAX_S:
            self._held_since = now
            return False
        return True

    def _vmm_busy(self, sandbox_id: str, pid: int | None) -> float | None:
        """Host CPU ms per second the sandbox's VMM used since the previous round; None for
        the first round of a VMM, or when it is unknown or unreadable."""
        now = self.clock()
        used = vmm_cpu_s(pid) if pid else None
        before = self._cpu.get(sandbox_id)
        if used is None or pid is None:
            self._cpu.pop(sandbox_id, None)
            return None
        self._cpu[sandbox_id] = (pid, used, now)
        if before is None or before[0] != pid:
            return None
        return max(used - before[1], 0.0) * 1000 / max(now - before[2], 1e-3)

    def _may_repeat(self, sandbox_id: str, busy: float) -> bool:
        """Whether this round repeats the last answer instead of asking (module doc)."""
        asked = self._asked.get(sandbox_id)
        return (busy < IDLE_CPU_MS_PER_S and asked is not None
                and self.clock() - asked < REFRESH_S and bool(self._samples.get(sandbox_id)))

    def _repeat(self, sandbox_id: str, busy: float) -> None:
        last = self._samples[sandbox_id][-1]
        self._add(sandbox_id, {**last, **_stamp(int(time.time())),
                               "cpuUsedPct": _vmm_pct(busy, last["cpuCount"])})
        self._repeated.add(sandbox_id)

    async def _sample(self, sandbox_id: str, host_ip: str, token: str | None,
                      after_repeats: float | None) -> None:
        """Ask the guest; ``after_repeats``: the VMM's ms/s over this round when the
        previous samples were repeats (then it gives ``cpuUsedPct``)."""
        client = EnvdClient(f"http://{host_ip}:{ENVD_PORT}", token, client=self._http)
        self._asked.pop(sandbox_id, None)  # repeats resume only after a good answer
        try:
            sample = _parse(await client.metrics(timeout=SAMPLE_TIMEOUT_S))
        except httpx.HTTPError as e:  # no connection: envd not up (yet), or going away
            log.debug("sandbox %s: metrics unavailable: %s", sandbox_id, e)
            return
        except (EnvdError, BadSample) as e:
            self._failed(sandbox_id, f"metrics skipped: {e}")
            return
        except Exception:
            self._failed(sandbox_id, "metrics skipped: unexpected error", exc_info=True)
            return
        if after_repeats is not None:
            sample["cpuUsedPct"] = _vmm_pct(after_repeats, sample["cpuCount"])
        self._failing.discard(sandbox_id)
        self._repeated.discard(sandbox_id)
        self._asked[sandbox_id] = self.clock()
        self._add(sandbox_id, sample)

    def _add(self, sandbox_id: str, sample: dict[str, Any]) -> None:
        self._samples.setdefault(sandbox_id, deque(maxlen=self.keep)).append(sample)

    def _failed(self, sandbox_id: str, message: str, exc_info: bool = False) -> None:
        level = logging.DEBUG if sandbox_id in self._failing else logging.WARNING
        self._failing.add(sandbox_id)
        log.log(level, "sandbox %s: %s", sandbox_id, message, exc_info=exc_info,
                extra={"sandbox_id": sandbox_id, "op": "metrics"})

    def samples(self, sandbox_id: str, start: int | None, end: int | None) -> list[dict[str, Any]]:
        return [s for s in self._samples.get(sandbox_id, ())
                if (start is None or s["timestampUnix"] >= start)
                and (end is None or s["timestampUnix"] <= end)]
