"""Persistent snapshots and forks (spec 2.3): ``POST /sandboxes/{id}/snapshots``,
``GET /snapshots``, ``GET /snapshots/{id}``, ``POST /sandboxes/{id}/fork``. A snapshot is
removed through ``DELETE /templates/{id}`` (templates.py), as E2B's SDK does it."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from fastapi.responses import JSONResponse

from ..orchestrator.errors import TemplateNotFound
from ..orchestrator.timing import server_timing
from ..store import TemplateKind, TemplateRecord
from . import listing, views
from .errors import public_error
from .models import ForkRequest, SnapshotRequest

router = APIRouter()


def _info(t: TemplateRecord) -> dict[str, Any]:
    return {"snapshotID": t.id, "names": t.names, "cpuCount": t.cpu_count,
            "memoryMB": t.memory_mb, "diskSizeMB": t.disk_size_mb,
            "createdAt": views.rfc3339(t.created_at), "updatedAt": views.rfc3339(t.updated_at),
            **({"sandboxID": t.source_sandbox} if t.source_sandbox else {})}


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(request: Request, sandbox_id: str,
                          body: Annotated[SnapshotRequest | None, Body()] = None) -> Response:
    timings: dict[str, float] = {}
    called = time.perf_counter()
    snap = await request.app.state.orchestrator.snapshot(
        sandbox_id, body.name if body else None, timings)
    returned = time.perf_counter()
    info = _info(snap)
    # Server-Timing covers the whole request: ``api`` (what the request spent outside the
    # orchestrator: auth, body, this handler), then the orchestrator's phases
    # (``Orchestrator.snapshot``: record changes, sandbox and snapshot locks, the capture's
    # steps, compaction queue, publish), and, marked as a total, the request as a whole.
    received = request.scope.get("aenv.received", called)
    now = time.perf_counter()
    timings = {"api": now - received - (returned - called), **timings}
    headers = {"Server-Timing": server_timing(timings, {"total": now - received})}
    return JSONResponse(info, status_code=201, headers=headers)


@router.get("/snapshots")
async def list_snapshots(request: Request, sandboxID: str | None = None,
                         name: str | None = None, limit: int = listing.DEFAULT_LIMIT,
                         nextToken: str | None = None) -> Response:
    snaps = request.app.state.orchestrator.templates.list(
        kind=TemplateKind.SNAPSHOT, source_sandbox=sandboxID, name=name)
    start = int(nextToken) if nextToken and nextToken.isdigit() else 0
    page = snaps[start:start + max(1, min(limit, listing.MAX_LIMIT))]
    more = start + len(page) < len(snaps)
    headers = {"X-Next-Token": str(start + len(page))} if more else {}
    return JSONResponse([_info(s) for s in page], headers=headers)


@router.get("/snapshots/{snapshot_id}")
async def get_snapshot(request: Request, snapshot_id: str) -> Response:
    snap = request.app.state.orchestrator.templates.get(snapshot_id)
    if snap is None or snap.kind != TemplateKind.SNAPSHOT:
        raise TemplateNotFound(snapshot_id)
    return JSONResponse(_info(snap))


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(request: Request, sandbox_id: str,
               body: Annotated[ForkRequest | None, Body()] = None) -> Response:
    count = body.count if body and body.count is not None else 1
    timings: dict[str, float] = {}
    results = await request.app.state.orchestrator.fork(
        sandbox_id, count, body.timeout if body else None, timings)
    domain = request.app.state.domain
    out = []
    for r in results:
        if isinstance(r, Exception):
            code, message = public_error(r)  # never a host path or a VMM log
            out.append({"error": {"code": code, "message": message}})
        else:
            out.append({"sandbox": views.sandbox(r, domain)})
    return views.timed_json(out, 201, timings)
