"""Records as the E2B SDKs expect to read them (keys and formats exactly as in the spec)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse

from ..egress.socks import public_option
from ..envd.state import ENVD_VERSION
from ..orchestrator.timing import GUEST_PHASES, WAIT_PHASES, host_side, server_timing
from ..store import SandboxRecord, SandboxState

# The API folds aenv's lifecycle states (the live ones) into the two E2B knows, by name.
_API_STATE: dict[SandboxState, str] = {
    SandboxState.CREATING: "running",
    SandboxState.RUNNING: "running",
    SandboxState.RESUMING: "running",
    SandboxState.SNAPSHOTTING: "running",
    SandboxState.FORKING: "running",
    SandboxState.KILLING: "running",
    SandboxState.PAUSING: "paused",
    SandboxState.PAUSED: "paused",
}
log = logging.getLogger(__name__)

# The states E2B's API knows: what a list's ``state`` filter may name.
API_STATES = frozenset(_API_STATE.values())


def internal_states(api_states: set[str]) -> tuple[SandboxState, ...]:
    """The lifecycle states that the API shows as any of ``api_states``."""
    return tuple(k for k, v in _API_STATE.items() if v in api_states)


def timed_json(body: Any, status: int, timings: dict[str, float]) -> JSONResponse:
    """A JSON answer carrying ``timings`` (seconds per phase) as a ``Server-Timing`` header,
    so clients and benchmarks see where the time of the operation went."""
    # A start (create, resume, connect) also reports its host-side share: what a KVM host
    # pays in full, apart from the guest's own execution.
    totals = {"host": host_side(timings)} if "envd_init" in timings else None
    headers = {"Server-Timing": server_timing(timings, totals)} if timings else None
    if totals is not None:
        log_start(str(body.get("sandboxID", "?")), timings)
    return JSONResponse(body, status_code=status, headers=headers)


def log_start(sandbox_id: str, timings: dict[str, float]) -> None:
    """One line per start with its split (what an operator and ``benchmarks/burst.py``
    read): the host's work, the guest's execution (what TCG slows and KVM does not), and
    the wait in the start queue."""
    guest = sum(v for k, v in timings.items() if k in GUEST_PHASES)
    queue = sum(v for k, v in timings.items() if k in WAIT_PHASES)
    log.info("sandbox %s: started in %.1f ms (host %.1f ms, guest %.1f ms, queue %.1f ms)",
             sandbox_id, sum(timings.values()) * 1000, host_side(timings) * 1000,
             guest * 1000, queue * 1000)


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


def api_state(rec: SandboxRecord) -> str:
    return _API_STATE.get(rec.state, "running")


def sandbox(rec: SandboxRecord, domain: str) -> dict[str, Any]:
    """``Sandbox``: the create / connect / resume / fork answer."""
    out: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "envdVersion": ENVD_VERSION,
        "trafficAccessToken": rec.traffic_token,
        "domain": domain,
    }
    if rec.alias:
        out["alias"] = rec.alias
    if rec.envd_token:
        out["envdAccessToken"] = rec.envd_token
    return out


def listed(rec: SandboxRecord) -> dict[str, Any]:
    """``ListedSandbox``."""
    out: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "startedAt": rfc3339(rec.started_at),
        "endAt": rfc3339(rec.end_at),
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_size_mb,
        "state": api_state(rec),
        "envdVersion": ENVD_VERSION,
        "metadata": rec.metadata,
        "volumeMounts": [{"name": m["name"], "path": m["path"]}
                         for m in rec.volume_mounts or ()],
    }
    if rec.alias:
        out["alias"] = rec.alias
    return out


def detail(rec: SandboxRecord, domain: str) -> dict[str, Any]:
    """``SandboxDetail``; keeps token and domain, which SDKs <= 2.3 connect with."""
    out = listed(rec)
    out["domain"] = domain
    out["allowInternetAccess"] = rec.allow_internet
    out["lifecycle"] = {"autoResume": rec.auto_resume,
                        "onTimeout": "pause" if rec.auto_pause else "kill"}
    if rec.envd_token:
        out["envdAccessToken"] = rec.envd_token
    if rec.network:
        out["network"] = public_network(rec.network)
    if rec.pause_mode and api_state(rec) == "paused":
        out["pauseMode"] = rec.pause_mode
    return out


def public_network(network: dict[str, Any]) -> dict[str, Any]:
    """A sandbox's ``network`` as it is read back: ``egressProxy`` without its password
    and CA (spec part 2, 3.3)."""
    if not network.get("egressProxy"):
        return network
    return {**network, "egressProxy": public_option(network["egressProxy"])}
