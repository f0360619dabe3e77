"""Where lifecycle time goes: per-phase durations, measured by ``PhaseTimer``
(``aenv.phase_timer``, re-exported here) and kept as Prometheus histograms.

Phases of a create: ``orchestrator`` (checks, store writes), then what the machines report
(``slot``, ``disk``, ``prepare``, ``vmm``, ``kernel``, ``init``, ``envd``, ``envd_init``).
The API adds ``api`` and returns all of them in a ``Server-Timing`` header; resume, connect
and fork answers carry their phases the same way (``parse_server_timing`` reads them back).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Histogram

from ..phase_timer import PhaseTimer as PhaseTimer  # re-exported: the orchestrator's timer

PHASE_SECONDS = Histogram(
    "aenv_sandbox_phase_seconds", "Duration of one phase of a sandbox operation",
    ["operation", "phase"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
             30, 60),
)


def record_phases(operation: str, phases: Mapping[str, float]) -> None:
    for phase, seconds in phases.items():
        PHASE_SECONDS.labels(operation, phase).observe(max(seconds, 0.0))


def server_timing(phases: Mapping[str, float]) -> str:
    """``Server-Timing`` header value (milliseconds, as the header wants)."""
    return ", ".join(f"{k};dur={v * 1000:.3f}" for k, v in phases.items())


def parse_server_timing(header: str) -> dict[str, float]:
    """``api;dur=1.2, slot;dur=0.3`` -> ``{"api": 1.2, "slot": 0.3}`` (milliseconds)."""
    phases: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key == "dur":
                phases[name] = float(value)
    return phases
