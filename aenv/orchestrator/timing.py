"""Where lifecycle time goes: per-phase durations, measured by ``PhaseTimer``
(``aenv.phase_timer``, re-exported here) and kept as Prometheus histograms.

Phases of a create: ``orchestrator`` (checks, store writes), then what the machines report
(``slot``, ``disk``, ``prepare``, ``vmm``, ``kernel``, ``init``, ``envd``, ``envd_init``).
The API adds ``api`` and returns all of them in a ``Server-Timing`` header; resume, connect
and fork answers carry their phases the same way (``parse_server_timing`` reads them back).
A start's header also carries ``host``, the sum of its host-side phases (all but the
guest's, ``GUEST_PHASES``), marked as a total.
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


# Phases of a start in which the guest executes (its boot, envd coming up and answering
# /init): what a KVM host runs at native speed and TCG emulates. Every other phase is the
# host's own work (API, store, slot, disk, VMM start, state load), paid in full on any host.
GUEST_PHASES = frozenset({"kernel", "init", "envd", "envd_init"})
# Phases that wait for others (a create queued behind the start limit): neither.
WAIT_PHASES = frozenset({"queue"})
TOTAL = "total"  # the ``desc`` of a Server-Timing entry that sums others (not a phase)


def host_side(phases: Mapping[str, float]) -> float:
    """The host's share of a start: every phase but the guest's (``GUEST_PHASES``) and
    waits (``WAIT_PHASES``)."""
    return sum(v for k, v in phases.items() if k not in GUEST_PHASES | WAIT_PHASES)


def server_timing(phases: Mapping[str, float],
                  totals: Mapping[str, float] | None = None) -> str:
    """``Server-Timing`` header value (milliseconds, as the header wants). ``totals`` are
    sums over phases (e.g. ``host``), marked ``desc="total"`` so that a reader adding up
    the phases can leave them out (``parse_server_timing`` does)."""
    entries = [f"{k};dur={v * 1000:.3f}" for k, v in phases.items()]
    entries += [f'{k};dur={v * 1000:.3f};desc="{TOTAL}"' for k, v in (totals or {}).items()]
    return ", ".join(entries)


def parse_server_timing(header: str, *, totals: bool = False) -> dict[str, float]:
    """``api;dur=1.2, slot;dur=0.3`` -> ``{"api": 1.2, "slot": 0.3}`` (milliseconds): the
    phases, or with ``totals`` only the entries marked as sums of phases."""
    phases: dict[str, float] = {}
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        fields = dict(param.partition("=")[::2] for param in params)
        if not name or "dur" not in fields:
            continue
        if (fields.get("desc", "").strip('"') == TOTAL) == totals:
            phases[name] = float(fields["dur"])
    return phases
