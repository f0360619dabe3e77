"""Template routes: E2B's build API (v3 request, file upload, v2 build start, status with a
log offset), listing, aliases and deletion. Persistent snapshots share ``DELETE
/templates/{id}`` with templates.

COPY uploads (spec part 2, 5.3): ``GET /templates/{id}/files/{hash}`` answers
``present:true`` for an archive already stored, else an upload link like E2B's presigned
one: no API key, a token (HMAC of template, hash and expiry under the server's upload
secret) and an expiry, ``UPLOAD_LINK_TTL_S`` (E2B's 30 minutes) unless ``create_api`` got
another. The ``PUT`` on it is checked for that token and expiry when it starts (403),
then streams to disk under its own size limit (``create_api(upload_limit=)``, 413), never
through the API's 1 MiB body limit. An archive stored for a hash is kept: a later upload
for it is read, dropped and answered 200 (E2B overwrites through S3; aenv keeps the first
complete upload, and 200 rather than 409 because JS SDKs upload steps in parallel and two
COPY steps can share a hash). The body must be a tar (400 otherwise). Whether it matches
its ``filesHash`` is not checked here: that needs the COPY step's ``src`` and ``dest``,
known once a build names them (``build_archives.verify_files_hash``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from ..orchestrator.builds import Builder
from ..orchestrator.errors import TemplateNotFound
from ..storage import build_archives
from ..store import TemplateRecord, TemplateStore
from .errors import ApiError
from .models import _Body
from .views import rfc3339

router = APIRouter()
LOGS_PAGE = 100
UPLOAD_LINK_TTL_S = 30 * 60
# A COPY context lands on the build VM's disk (4 GiB by default) beside what it unpacks to.
UPLOAD_LIMIT_BYTES = 4 << 30


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


def _upload_token(request: Request, template_id: str, files_hash: str, expires: int) -> str:
    key = request.app.state.upload_secret
    message = f"upload:{template_id}:{files_hash}:{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


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
    expires = int(time.time() + request.app.state.upload_link_ttl)
    token = _upload_token(request, template_id, files_hash, expires)
    url = str(request.url_for("upload_files", template_id=template_id, files_hash=files_hash))
    return JSONResponse({"present": False, "url": f"{url}?expires={expires}&token={token}"},
                        status_code=201)


@router.put("/templates/{template_id}/files/{files_hash}/upload", name="upload_files")
async def upload_files(request: Request, template_id: str, files_hash: str,
                       token: str = "", expires: str = "") -> Response:
    """Where the SDK PUTs a COPY archive (it sends no API key: the URL carries a token)."""
    valid = expires.isdigit() and hmac.compare_digest(
        token.encode(), _upload_token(request, template_id, files_hash, int(expires)).encode())
    if not valid:
        raise ApiError(403, "invalid upload token")
    if int(expires) < time.time():
        raise ApiError(403, "upload link expired; ask for a new one")
    if store(request).get(template_id) is None:
        raise TemplateNotFound(template_id)
    path = builder(request).file_path(files_hash)
    try:
        await build_archives.store_upload(request.stream(), path,
                                       limit=request.app.state.upload_limit)
    except build_archives.UploadTooLarge:
        raise ApiError(413, "upload too large") from None
    except build_archives.ArchiveError as e:
        raise ApiError(400, f"invalid COPY archive: {e}") from None
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
