"""Template routes: E2B's build API (v3 request, file upload, v2 build start, status with a
log offset), listing, aliases and deletion. Persistent snapshots share ``DELETE
/templates/{id}`` with templates."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from ..orchestrator.builds import Builder
from ..orchestrator.errors import TemplateNotFound
from ..store import TemplateRecord, TemplateStore
from .errors import ApiError
from .models import _Body
from .views import rfc3339

router = APIRouter()
LOGS_PAGE = 100


class TemplateRequest(_Body):
    name: str | None = Field(default=None, max_length=128)
    alias: str | None = Field(default=None, max_length=128)
    tags: list[str] | None = None
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=128, le=262144)


class Step(_Body):
    type: str
    args: list[str] | None = None
    filesHash: str | None = None
    force: bool | None = None


class BuildStart(_Body):
    fromImage: str | None = None
    fromTemplate: str | None = None
    steps: list[Step] | None = None
    startCmd: str | None = None
    readyCmd: str | None = None
    force: bool | None = None


def builder(request: Request) -> Builder:
    return request.app.state.builder


def store(request: Request) -> TemplateStore:
    return request.app.state.orchestrator.templates


def _upload_token(request: Request, template_id: str, files_hash: str) -> str:
    key = request.app.state.upload_secret
    return hmac.new(key, f"{template_id}:{files_hash}".encode(), hashlib.sha256).hexdigest()


def _template(t: TemplateRecord) -> dict[str, Any]:
    return {
        "templateID": t.id, "buildID": t.build_id, "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb, "diskSizeMB": t.disk_size_mb, "public": t.public,
        "aliases": [n for n in t.names if ":" not in n], "names": t.names,
        "createdAt": rfc3339(t.created_at), "updatedAt": rfc3339(t.updated_at),
        "createdBy": None,
        "lastSpawnedAt": rfc3339(t.last_spawned_at) if t.last_spawned_at else None,
        "spawnCount": t.spawn_count, "buildCount": t.build_count, "envdVersion": "0.6.13",
        "buildStatus": t.status,
    }


@router.post("/v3/templates", status_code=202)
async def request_build(request: Request, body: TemplateRequest) -> Response:
    name = body.name or body.alias
    if not name:
        raise ApiError(400, "template name must be provided")
    tpl, build, tags = builder(request).request(
        name, tags=body.tags, cpu_count=body.cpuCount, memory_mb=body.memoryMB)
    return JSONResponse({"templateID": tpl.id, "buildID": build.id, "public": False,
                         "names": [name], "tags": tags, "aliases": [name.split(":")[0]]},
                        status_code=202)


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def file_upload_link(request: Request, template_id: str, files_hash: str) -> Response:
    if store(request).get(template_id) is None:
        raise TemplateNotFound(template_id)
    path = builder(request).file_path(files_hash)
    if path.exists():
        return JSONResponse({"present": True}, status_code=201)
    token = _upload_token(request, template_id, files_hash)
    url = str(request.url_for("upload_files", template_id=template_id, files_hash=files_hash))
    return JSONResponse({"present": False, "url": f"{url}?token={token}"}, status_code=201)


@router.put("/templates/{template_id}/files/{files_hash}/upload", name="upload_files")
async def upload_files(request: Request, template_id: str, files_hash: str,
                       token: str = "") -> Response:
    """Where the SDK PUTs a COPY archive (it sends no API key: the URL carries a token)."""
    if not hmac.compare_digest(token, _upload_token(request, template_id, files_hash)):
        raise ApiError(403, "invalid upload token")
    path = builder(request).file_path(files_hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".part-{os.getpid()}")
    with open(tmp, "wb") as f:
        async for chunk in request.stream():
            f.write(chunk)
    os.replace(tmp, path)
    return Response(status_code=200)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(request: Request, template_id: str, build_id: str,
                      body: BuildStart) -> Response:
    builder(request).start(template_id, build_id, body.model_dump(exclude_none=True))
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(request: Request, template_id: str, build_id: str,
                       logsOffset: Annotated[int, Query(ge=0)] = 0,
                       limit: Annotated[int, Query(ge=1, le=LOGS_PAGE)] = LOGS_PAGE,
                       level: str | None = None) -> Response:
    b = store(request).get_build(build_id)
    if b is None or b.template_id != template_id:
        raise TemplateNotFound(f"{template_id}/{build_id}")
    entries = store(request).logs(build_id, logsOffset, limit)
    if level:
        entries = [e for e in entries if e["level"] == level]
    log_entries = [{"timestamp": rfc3339(e["ts"]), "message": e["message"], "level": e["level"],
                    **({"step": e["step"]} if e["step"] else {})} for e in entries]
    out: dict[str, Any] = {"templateID": template_id, "buildID": build_id, "status": b.status,
                           "logs": [e["message"] for e in entries], "logEntries": log_entries}
    if b.status == "error":
        out["reason"] = {"message": b.reason or "build failed",
                         **({"step": b.reason_step} if b.reason_step else {})}
    return JSONResponse(out)


@router.get("/templates")
@router.get("/v2/templates")
async def list_templates(request: Request) -> Response:
    return JSONResponse([_template(t) for t in store(request).list(kind="template")])


@router.get("/templates/aliases/{alias}")
async def alias(request: Request, alias: str) -> Response:
    tid = store(request).template_id_for_name(alias)
    if tid is None:
        raise TemplateNotFound(alias)
    return JSONResponse({"templateID": tid, "public": False})


@router.get("/templates/{template_id}")
async def get_template(request: Request, template_id: str) -> Response:
    t = store(request).get(template_id)
    if t is None:
        raise TemplateNotFound(template_id)
    return JSONResponse({**_template(t), "builds": []})


@router.delete("/templates/{template_id}", status_code=204)
async def delete_template(request: Request, template_id: str) -> Response:
    orchestrator = request.app.state.orchestrator
    orchestrator.delete_template(template_id)
    await orchestrator.collect_garbage()
    return Response(status_code=204)
