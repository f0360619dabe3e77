"""Helpers shared by the benchmark scripts: latency summaries, the one-JSON-object output,
an envd started on the host for the length of a benchmark, a server started in a child
process (``spawn_child``).

Each benchmark prints exactly one JSON object on stdout (figures in milliseconds unless a
key says otherwise); progress and notes go to stderr. Timings on the shared 2-core
development machine are noisy: compare runs, not single numbers. To make runs comparable
across machines and days, ``emit`` adds a ``host`` block: the CPU, the load, the share of
CPU time the hypervisor stole while the benchmark ran, and ``speed_ref_ms`` (a fixed
pure-Python loop timed when this module was imported and again at the end; on one machine
it has been seen to vary by 50 % within an hour, which moves every TCG figure with it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import httpx

if TYPE_CHECKING:
    from aenv.config import Settings

ROOT = Path(__file__).resolve().parent.parent


# Below this many samples a 99th percentile is only the largest value seen: ``summary``
# reports it as null (``p99_needs_n``) rather than print a maximum under the name p99.
P99_MIN_N = 100


def percentile(values: list[float], p: float) -> float:
    """Percentile ``p`` (0..100) of a non-empty list, interpolated between the two nearest
    ranks (numpy's default): the p50 of an even count is the mean of the middle two, not
    the lower one as a nearest-rank p50 would be."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no samples")
    pos = (len(ordered) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(ms: list[float]) -> dict[str, Any]:
    """n, p50, p99, min, max (and mean) of a list of milliseconds, rounded to 0.01 ms.

    Every figure carries its sample count ``n``. ``p99`` is null below ``P99_MIN_N``
    samples (``p99_needs_n`` says so): with fewer it is just the maximum, already in
    ``max``. An empty list gives ``{"n": 0}``."""
    if not ms:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(ms), "p50": round(percentile(ms, 50), 2)}
    if len(ms) >= P99_MIN_N:
        out["p99"] = round(percentile(ms, 99), 2)
    else:
        out["p99"] = None
        out["p99_needs_n"] = P99_MIN_N
    out.update({"min": round(min(ms), 2), "max": round(max(ms), 2),
                "mean": round(sum(ms) / len(ms), 2)})
    return out


def tail(s: dict[str, Any]) -> float | None:
    """The honest tail of a ``summary``: its p99 when there were enough samples, else None."""
    value = s.get("p99")
    return None if value is None else float(value)


def expect_status(r: httpx.Response, *statuses: int) -> httpx.Response:
    """``r`` when its status is one of ``statuses``; otherwise raise with the body, so a
    benchmark never times an error answer as if it were the operation."""
    if r.status_code not in statuses:
        raise RuntimeError(f"{r.request.method} {r.request.url.path} answered "
                           f"{r.status_code} (expected {statuses}): {r.text[:300]}")
    return r


def phase_summaries(rows: list[dict[str, float]], phases: tuple[str, ...] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """``summary`` per ``Server-Timing`` phase over the rows that report it: a phase absent
    from a row is left out (its ``n`` is smaller), never counted as 0 ms. ``phases``: the
    keys to report (default: every key seen)."""
    keys = phases if phases is not None else tuple(dict.fromkeys(k for r in rows for k in r))
    return {k: summary([r[k] for r in rows if k in r]) for k in keys}


def speed_ref_ms(loops: int = 1_000_000) -> float:
    """Best of three timings of a fixed pure-Python loop (ms): a CPU speed reference."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(loops):
            total += i
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def _cpu_times() -> list[int]:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq
    steal ...), in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


_BEGIN = (_cpu_times(), speed_ref_ms())


def host_conditions() -> dict[str, Any]:
    """What the host was like while the benchmark ran (see the module docstring)."""
    before, ref_begin = _BEGIN
    delta = [b - a for a, b in zip(before, _cpu_times(), strict=False)]
    total = sum(delta[:8]) or 1
    idle = delta[3] + delta[4]
    steal = delta[7] if len(delta) > 7 else 0
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f
                      if line.startswith("model name")), "unknown")
    return {"cpu": model, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "steal_pct": round(100 * steal / total, 1),
            "busy_pct": round(100 * (total - idle - steal) / total, 1),
            "speed_ref_ms": {"begin": ref_begin, "end": speed_ref_ms()}}


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's one JSON object, with ``host`` conditions added."""
    json.dump({**result, "host": host_conditions()}, sys.stdout, indent=2)
    sys.stdout.write("\n")


def private_settings(letters: str, net: int, warm_slots: int = 1) -> Settings:
    """The environment's settings with host objects of this benchmark's own: the name prefix
    ``letters`` + the last four digits of the pid, 10.<net>.0.0/24 for host addresses and
    10.<net>.1.0/24 for veths, ``warm_slots`` slots kept made."""
    from aenv.config import Settings

    return dataclasses.replace(
        Settings.from_env(), name_prefix=f"{letters}{os.getpid() % 10000:04d}",
        host_cidr=f"10.{net}.0.0/24", veth_cidr=f"10.{net}.1.0/24", warm_slots=warm_slots)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Envd:
    """``python -m aenv.envd`` on 127.0.0.1, initialised as the orchestrator does (default
    user, ``E2B_SANDBOX=true``, and an access token unless ``access_token=False``), or not
    at all with ``init=False`` (no token either). Use as a context manager; the process
    group is always stopped."""

    def __init__(self, *args: str, default_user: str = "user", access_token: bool = True,
                 init: bool = True, log_path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.init = init
        self.token = secrets.token_hex(16) if init and access_token else None
        self.default_user = default_user
        self._args = ["--default-user", default_user, *args]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.proc = spawn_envd(self.port, *self._args, log_path=self.log_path)
        try:
            wait_healthy(self.url, self.proc)
            if not self.init:
                return self
            body: dict[str, Any] = {"defaultUser": self.default_user,
                                    "envVars": {"E2B_SANDBOX": "true"}}
            if self.token:
                body["accessToken"] = self.token
            httpx.post(self.url + "/init", json=body, timeout=10).raise_for_status()
        except BaseException:
            stop(self.proc)
            raise
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc is not None:
            stop(self.proc)


def spawn_envd(port: int, *args: str, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start envd in its own process group; its output goes to ``log_path`` or nowhere."""
    cmd = [sys.executable, "-m", "aenv.envd", "--host", "127.0.0.1", "--port", str(port), *args]
    if log_path is None:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    with open(log_path, "wb") as log:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0,
                 poll_s: float = 0.002) -> None:
    """Poll ``GET /health`` until it answers 204."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"envd exited with {proc.returncode} before answering")
            try:
                if client.get(url + "/health").status_code == 204:
                    return
            except httpx.TransportError:
                pass
            time.sleep(poll_s)
    raise TimeoutError(f"{url}/health did not answer within {timeout}s")


def stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def spawn_child(argv: list[str], health_url: str, *, log_path: Path | None = None,
                env: dict[str, str] | None = None, timeout: float = 60.0
                ) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group (output to ``log_path`` or nowhere) and
    return once ``health_url`` answers below 500. A child that dies or never answers is
    stopped and reported with the tail of its log."""
    with open(log_path if log_path is not None else os.devnull, "ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if client.get(health_url).status_code < 500:
                        return proc
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
    except BaseException:  # interrupted while waiting: leave nothing behind
        stop(proc)
        raise
    stop(proc)
    tail = log_path.read_text(errors="replace")[-3000:] if log_path is not None else ""
    raise RuntimeError(f"{argv[:4]} did not answer {health_url} (exit {proc.returncode})\n"
                       f"{tail}")
