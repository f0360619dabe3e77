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

Tags (spec part 2, section 2; E2B's ``handlers/template_tags.go`` and ``id.ParseName``):
``POST /templates/tags {target, tags}`` points tags at the build ``target`` (``name:tag``,
no tag meaning ``default``) names, 201 ``{tags, buildID}``; ``DELETE /templates/tags {name,
tags}`` (a JSON body) removes them, 204, never ``default``; ``GET /templates/{ref}/tags``
lists them, 200 ``[{tag, buildID, createdAt}]``. A tag is trimmed and lowercased, of
``[a-z0-9._-]``, and not a UUID (``name:<build id>`` names a build). ``POST /v3/templates``
takes the tag in ``name`` and those in ``tags``; with none the build gets ``default``;
they move to the build when it is ready (the store's docstring says how references
resolve). ``{ref}`` arrives percent-encoded as one segment (``ns%2Fname%3Av1``): the tag
route matches it as a path. Build ids are UUIDs, which the Python SDK parses.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field, SecretStr

from ..orchestrator.builds import Builder
from ..orchestrator.errors import TemplateNotFound
from ..storage import build_archives
from ..store import BuildStatus, TemplateKind, TemplateRecord, TemplateStore
from ..store.templates import DEFAULT_TAG
from .errors import ApiError
from .models import AssignTemplateTags, DeleteTemplateTags, _Body
from .views import rfc3339

router = APIRouter()
LOGS_PAGE = 100
UPLOAD_LINK_TTL_S = 30 * 60
# A COPY context lands on the build VM's disk (4 GiB by default) beside what it unpacks to.
UPLOAD_LIMIT_BYTES = 4 << 30
_TAG = re.compile(r"^[a-z0-9._-]+$")
_BUILD_IDS = uuid.UUID("6f0c5a52-3c1e-4d59-9a53-6d1f3b0e2a71")  # namespace of derived ids


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


class RegistryAuth(_Body):
    """E2B's ``fromImageRegistry``: ``registry`` (username and password) is what aenv
    pulls with; ``aws`` and ``gcp`` are accepted here and refused by name at the start."""

    type: str
    username: str | None = None
    password: SecretStr | None = None

    def plain(self) -> dict[str, Any]:
        return {"type": self.type, "username": self.username,
                "password": self.password.get_secret_value() if self.password else None}


class BuildStart(_Body):
    fromImage: str | None = None
    fromTemplate: str | None = None
    fromImageRegistry: RegistryAuth | None = None
    steps: list[Step] | None = None
    startCmd: str | None = None
    readyCmd: str | None = None
    force: bool | None = None


def builder(request: Request) -> Builder:
    b: Builder = request.app.state.builder  # set by create_api
    return b


def store(request: Request) -> TemplateStore:
    s: TemplateStore = request.app.state.orchestrator.templates
    return s


def _upload_token(request: Request, template_id: str, files_hash: str, expires: int) -> str:
    key = request.app.state.upload_secret
    message = f"upload:{template_id}:{files_hash}:{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _clean_tags(tags: list[str]) -> list[str]:
    """E2B's ``ValidateAndDeduplicateTags``, in the order given."""
    out = []
    for tag in tags:
        clean = tag.strip().lower()
        if not _TAG.match(clean):
            raise ValueError(f"invalid tag '{tag}'")
        if _is_uuid(clean):
            raise ValueError(f"invalid tag '{tag}': tag cannot be a UUID")
        out.append(clean)
    return list(dict.fromkeys(out))


def _split_name(ref: str) -> tuple[str, str | None]:
    """``name[:tag]`` as E2B's ``ParseName`` cuts it: the name, and the tag (lowercased;
    None when there is none or it is ``default``). Names are kept as written: aenv has
    no namespaces to check them against."""
    name, sep, tag = ref.strip().partition(":")
    if not name.strip():
        raise ValueError(f"invalid template ID: '{name}'")
    if not sep:
        return name.strip(), None
    clean = tag.strip().lower()
    if not _TAG.match(clean):
        raise ValueError(f"invalid tag: '{tag}'")
    return name.strip(), None if clean == DEFAULT_TAG else clean


def _wire_build_id(build_id: str) -> str:
    """A build id as tag answers carry it: a UUID (the Python SDK parses it as one). Ids
    from before builds had UUIDs (the built-in template's) become one derived from them."""
    return build_id if _is_uuid(build_id) else str(uuid.uuid5(_BUILD_IDS, build_id))


def _named(request: Request, name: str) -> TemplateRecord:
    tpl = store(request).get(name)
    if tpl is None:
        raise TemplateNotFound(name)
    return tpl


def _template(t: TemplateRecord) -> dict[str, Any]:
    names = [n for n in t.names if ":" not in n]
    return {
        "templateID": t.id, "buildID": t.build_id, "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb, "diskSizeMB": t.disk_size_mb, "public": t.public,
        "aliases": names, "names": names,
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
    try:
        base, tag = _split_name(name)
    except ValueError as e:
        raise ApiError(400, f"Invalid name: {e}") from None
    try:
        tags = _clean_tags(([tag] if tag else []) + (body.tags or [])) or [DEFAULT_TAG]
    except ValueError as e:
        raise ApiError(400, f"Invalid tag: {e}") from None
    tpl, build, _ = builder(request).request(
        f"{base}:{tags[0]}", tags=tags[1:], cpu_count=body.cpuCount, memory_mb=body.memoryMB)
    build_id = build.id
    store(request).set_build_tags(build_id, tags)
    names = [n for n in tpl.names if ":" not in n] or [base]
    return JSONResponse({"templateID": tpl.id, "buildID": build_id, "public": False,
                         "names": names, "tags": tags, "aliases": names}, status_code=202)


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
    # The credentials go to the build in memory only: the stored spec must not hold them.
    registry = body.fromImageRegistry.plain() if body.fromImageRegistry else None
    builder(request).start(template_id, build_id,
                           body.model_dump(exclude_none=True, exclude={"fromImageRegistry"}),
                           registry=registry)
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
    if b.status == BuildStatus.ERROR:
        out["reason"] = {"message": b.reason or "build failed",
                         **({"step": b.reason_step} if b.reason_step else {})}
    return JSONResponse(out)


@router.get("/templates")
@router.get("/v2/templates")
async def list_templates(request: Request) -> Response:
    return JSONResponse([_template(t) for t in store(request).list(kind=TemplateKind.TEMPLATE)])


@router.get("/templates/aliases/{alias:path}")
async def alias(request: Request, alias: str) -> Response:
    """``Template.exists``: a name, or ``name:tag`` when that tag names a ready build."""
    tid = store(request).template_id_for_name(alias)  # a snapshot's name may hold a ':'
    if tid is None and ":" in alias:
        try:
            name, tag = _split_name(alias)
        except ValueError as e:
            raise ApiError(400, f"Invalid alias format: {e}") from None
        tid = store(request).template_id_for_name(name)
        if tid is None:
            raise TemplateNotFound(name)
        if store(request).tag_build(tid, tag or DEFAULT_TAG) is None:
            raise ApiError(404, f"tag '{tag or DEFAULT_TAG}' does not exist for template "
                                f"'{name}'")
    if tid is None:
        raise TemplateNotFound(alias)
    return JSONResponse({"templateID": tid, "public": False})


@router.post("/templates/tags", status_code=201)
async def assign_tags(request: Request, body: AssignTemplateTags) -> Response:
    """``Template.assign_tags(target, tags)``; checks in E2B's order."""
    if not body.tags:
        raise ApiError(400, "At least one tag is required")
    try:
        name, tag = _split_name(body.target)
    except ValueError as e:
        raise ApiError(400, f"Invalid target template format: {e}") from None
    tpl = _named(request, name)
    target = tag or DEFAULT_TAG
    build_id = store(request).tag_build(tpl.id, target)
    if build_id is None:
        raise ApiError(404, f"Template '{body.target}' with tag '{target}' not found")
    try:
        tags = _clean_tags(body.tags)
    except ValueError as e:
        raise ApiError(400, f"Invalid tag: {e}") from None
    store(request).assign_tags(tpl.id, build_id, tags)
    return JSONResponse({"tags": tags, "buildID": _wire_build_id(build_id)}, status_code=201)


@router.delete("/templates/tags", status_code=204)
async def remove_tags(request: Request, body: DeleteTemplateTags) -> Response:
    """``Template.remove_tags(name, tags)``: tags that are not there are no error."""
    try:
        tags = _clean_tags(body.tags)
    except ValueError as e:
        raise ApiError(400, f"Invalid tag: {e}") from None
    if not tags:
        raise ApiError(400, "At least one tag is required")
    if DEFAULT_TAG in tags:
        raise ApiError(400, f"Cannot delete the '{DEFAULT_TAG}' tag")
    try:
        name, tag = _split_name(body.name)
    except ValueError as e:
        raise ApiError(400, f"Invalid template name format: {e}") from None
    if tag is not None:
        raise ApiError(400, "Template name should not contain a tag, use the 'tags' field "
                            "instead")
    store(request).remove_tags(_named(request, name).id, tags)
    return Response(status_code=204)


@router.get("/templates/{template_id:path}/tags")
async def list_tags(request: Request, template_id: str) -> Response:
    """``Template.get_tags``: every tag of the template (a tag in the reference is ignored)."""
    try:
        name, _ = _split_name(template_id)
    except ValueError as e:
        raise ApiError(400, f"Invalid template reference: {e}") from None
    tags = store(request).tags(_named(request, name).id)
    return JSONResponse([{"tag": t.tag, "buildID": _wire_build_id(t.build_id),
                          "createdAt": rfc3339(t.created_at)} for t in tags])


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
