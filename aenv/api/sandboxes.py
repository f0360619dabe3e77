"""Sandbox routes of both SDK generations (spec section 2.3) with their exact status codes."""

from __future__ import annotations

import re
import time
from typing import Annotated

from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from ..orchestrator.service import DEFAULT_TIMEOUT_S, CreateOptions, Orchestrator
from ..orchestrator.timing import server_timing
from . import listing, network, views
from .errors import ApiError
from .models import (
    ConnectRequest,
    NewSandbox,
    PauseRequest,
    RefreshRequest,
    ResumeRequest,
    TimeoutRequest,
)

router = APIRouter()
router.include_router(network.router)

_IDEMPOTENCY_KEY = re.compile(r"^[a-z0-9-]{1,255}$")


def orch(request: Request) -> Orchestrator:
    o: Orchestrator = request.app.state.orchestrator  # set by create_api
    return o


def domain(request: Request) -> str:
    d: str = request.app.state.domain
    return d


async def _create(request: Request, body: NewSandbox, idem: str | None, v1: bool) -> Response:
    if idem is not None and not _IDEMPOTENCY_KEY.match(idem):
        raise ApiError(400, "Idempotency-Key must be 1-255 characters of [a-z0-9-]")
    opts = CreateOptions(
        template=body.templateID,
        timeout=body.timeout if body.timeout is not None else DEFAULT_TIMEOUT_S,
        metadata=body.metadata or {},
        env_vars=body.envVars or {},
        secure=True if not v1 or body.secure is None else body.secure,
        auto_pause=bool(body.autoPause),
        auto_pause_memory=body.autoPauseMemory is not False,
        auto_resume=bool(body.autoResume and body.autoResume.enabled),
        allow_internet=body.allow_internet_access,
        network=network.create_options(body.network),
        cpu_count=body.cpuCount,
        memory_mb=body.memoryMB,
        idempotency_key=idem,
        client_gone=request.is_disconnected,
        volume_mounts=_volume_mounts(request, body),
    )
    timings: dict[str, float] = {}
    t_handler = time.perf_counter()
    try:
        rec = await orch(request).create(opts, timings)
    finally:
        if opts.volume_mounts:  # held by resolve_mounts until the create ends
            await request.app.state.volumes.release(opts.volume_mounts)
    received = request.scope.get("aenv.received")
    if received is not None:
        timings = {"api": t_handler - received + (time.perf_counter() - t_handler
                                                  - sum(timings.values())), **timings}
    return views.timed_json(views.sandbox(rec, domain(request)), 201, timings)


def _volume_mounts(request: Request, body: NewSandbox) -> list[dict[str, str]] | None:
    """``volumeMounts`` by volume name, resolved (unknown name: 400)."""
    if not body.volumeMounts:
        return None
    service = request.app.state.volumes
    if service is None:
        raise ApiError(400, "volumes are not enabled on this server")
    mounts: list[dict[str, str]] = service.resolve_mounts(
        [m.model_dump() for m in body.volumeMounts])
    return mounts


@router.post("/v2/sandboxes")
async def create_v2(
    request: Request, body: NewSandbox,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    return await _create(request, body, idempotency_key, v1=False)


@router.post("/sandboxes")
async def create_v1(
    request: Request, body: NewSandbox,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    return await _create(request, body, idempotency_key, v1=True)


@router.get("/v2/sandboxes")
async def list_v2(
    request: Request,
    metadata: str | None = None,
    state: str | None = None,
    limit: int | None = None,
    nextToken: str | None = None,
    startedAfter: str | None = None,
    template: str | None = None,
    order: str = "desc",
) -> Response:
    page, token = listing.select(
        orch(request).sandboxes,
        metadata=listing.parse_metadata_filter(metadata),
        states=listing.parse_states(state),
        started_after=listing.parse_time(startedAfter),
        template=template, order=order, limit=limit, next_token=nextToken,
    )
    headers = {"X-Next-Token": token} if token else {}
    return JSONResponse([views.listed(r) for r in page], headers=headers)


@router.get("/sandboxes")
async def list_v1(request: Request, metadata: str | None = None) -> Response:
    """1.x SDKs: running sandboxes only, no pagination."""
    page, _ = listing.select(
        orch(request).sandboxes, metadata=listing.parse_metadata_filter(metadata),
        states={"running"}, limit=listing.MAX_LIMIT,
    )
    return JSONResponse([views.listed(r) for r in page])


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(request: Request, sandbox_id: str) -> Response:
    return JSONResponse(views.detail(orch(request).get(sandbox_id), domain(request)))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(request: Request, sandbox_id: str) -> Response:
    await orch(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(request: Request, sandbox_id: str, body: TimeoutRequest) -> Response:
    orch(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(request: Request, sandbox_id: str,
                  body: Annotated[RefreshRequest | None, Body()] = None) -> Response:
    duration = body.duration if body and body.duration is not None else DEFAULT_TIMEOUT_S
    orch(request).extend_timeout(sandbox_id, duration)
    return Response(status_code=204)


async def _connect(request: Request, sandbox_id: str, timeout: int | None) -> Response:
    timings: dict[str, float] = {}
    rec, resumed = await orch(request).connect(sandbox_id, timeout, timings)
    return views.timed_json(views.sandbox(rec, domain(request)), 201 if resumed else 200, timings)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_v2(request: Request, sandbox_id: str,
                     body: Annotated[ConnectRequest | None, Body()] = None) -> Response:
    return await _connect(request, sandbox_id, body.timeout if body else None)


@router.post("/sandboxes/{sandbox_id}/connect")
async def connect_v1(request: Request, sandbox_id: str,
                     body: Annotated[ConnectRequest | None, Body()] = None) -> Response:
    return await _connect(request, sandbox_id, body.timeout if body else None)


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume(request: Request, sandbox_id: str,
                 body: Annotated[ResumeRequest | None, Body()] = None) -> Response:
    """Deprecated (SDK <= 2.3): 201 when resumed, 409 when already running."""
    timings: dict[str, float] = {}
    rec = await orch(request).resume(sandbox_id, body.timeout if body else None, timings)
    return views.timed_json(views.sandbox(rec, domain(request)), 201, timings)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(request: Request, sandbox_id: str,
                body: Annotated[PauseRequest | None, Body()] = None) -> Response:
    memory = not (body and body.memory is False)
    timings: dict[str, float] = {}
    called = time.perf_counter()
    await orch(request).pause(sandbox_id, memory=memory, timings=timings)
    returned = time.perf_counter()
    # Server-Timing as a snapshot's answer has it (snapshots.py): ``api``, the
    # orchestrator's phases (``Orchestrator.pause``), the request as a total.
    received = request.scope.get("aenv.received", called)
    now = time.perf_counter()
    timings = {"api": now - received - (returned - called), **timings}
    return Response(status_code=204, headers={
        "Server-Timing": server_timing(timings, {"total": now - received})})


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(request: Request, sandbox_id: str,
                  start: Annotated[int | None, Query()] = None,
                  end: Annotated[int | None, Query()] = None) -> Response:
    o = orch(request)
    o.get(sandbox_id)
    samples = request.app.state.metrics.samples(sandbox_id, start, end)
    return JSONResponse(samples)


@router.get("/sandboxes/{sandbox_id}/logs")
async def logs(request: Request, sandbox_id: str, start: int | None = None,
               limit: int = 1000) -> Response:
    rec = orch(request).get(sandbox_id)
    entries = request.app.state.logs(rec, start, limit)
    return JSONResponse({"logs": [{"timestamp": e["timestamp"], "line": e["line"]}
                                  for e in entries],
                         "logEntries": [{"timestamp": e["timestamp"], "message": e["line"],
                                         "level": "info", "fields": {}} for e in entries]})

