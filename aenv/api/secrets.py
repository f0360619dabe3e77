"""E2B Secrets (spec part 2, section 4.4): ``POST /secrets``, ``GET /secrets``,
``GET``/``POST``/``DELETE /secrets/{idOrName}``.

Names are lower-cased before they are stored and are unique; ``sec_`` starts ids only.
Metadata: at most 32 entries, keys up to 128 bytes, values up to 1024, 8192 in all. Every
answer is the ``Secret`` object without the value: the value goes in and never comes
back out of the API (the egress proxy reads it, ``aenv.egress``). Pages are ordered by
creation; ``X-Next-Token`` is an opaque cursor. The store is ``app.state.secrets``
(``Secrets``): the node's own, or in a cluster the shared one, which a gateway serves too.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ..store.secrets import ID_PREFIX, SecretNameTaken, SecretRecord, Secrets
from . import listing, views
from .errors import ApiError
from .models import _Body

router = APIRouter()

MAX_NAME = 128
MAX_VALUE_BYTES = 64 * 1024
MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY = 128
MAX_METADATA_VALUE = 1024
MAX_METADATA_TOTAL = 8192
# Names go into URL paths and into ``${e2b.secrets.<name>}`` placeholders.
_FORBIDDEN = set("{}/ ")


class NewSecret(_Body):
    name: str
    value: str
    metadata: dict[str, str] | None = None


class SecretUpdate(_Body):
    value: str
    metadata: dict[str, str] | None = None


def _store(request: Request) -> Secrets:
    store: Secrets | None = request.app.state.secrets
    if store is None:
        raise ApiError(501, "secrets are not enabled on this server")
    return store


def check_name(raw: str) -> str:
    """The name as stored (lower case), or a 400 saying what is wrong with it."""
    name = raw.lower()
    if not name or len(name.encode()) > MAX_NAME:
        raise ApiError(400, f"secret name must be 1 to {MAX_NAME} bytes")
    if any(c in _FORBIDDEN or not c.isprintable() for c in name):
        raise ApiError(400, "secret name may not contain '{', '}', '/', spaces or "
                       "control characters")
    if name.startswith(ID_PREFIX):
        raise ApiError(400, f"secret names may not start with '{ID_PREFIX}' (kept for ids)")
    return name


def _check_value(value: str) -> None:
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise ApiError(400, f"secret value is larger than {MAX_VALUE_BYTES} bytes")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ApiError(400, f"metadata: at most {MAX_METADATA_ENTRIES} entries")
    total = 0
    for k, v in metadata.items():
        if len(k.encode()) > MAX_METADATA_KEY:
            raise ApiError(400, f"metadata key '{k[:32]}...' is longer than "
                           f"{MAX_METADATA_KEY} bytes")
        if len(v.encode()) > MAX_METADATA_VALUE:
            raise ApiError(400, f"metadata value of '{k}' is longer than "
                           f"{MAX_METADATA_VALUE} bytes")
        total += len(k.encode()) + len(v.encode())
    if total > MAX_METADATA_TOTAL:
        raise ApiError(400, f"metadata is larger than {MAX_METADATA_TOTAL} bytes in all")


def _view(rec: SecretRecord) -> dict[str, Any]:
    return {"secretID": rec.id, "name": rec.name, "currentVersion": rec.version,
            "metadata": rec.metadata, "createdAt": views.rfc3339(rec.created_at),
            "updatedAt": views.rfc3339(rec.updated_at)}


def _not_found(id_or_name: str) -> ApiError:
    return ApiError(404, f"secret '{id_or_name}' not found")


def _cursor(rec: SecretRecord) -> str:
    return base64.urlsafe_b64encode(json.dumps([rec.created_at, rec.id]).encode()).decode()


def _after(token: str) -> tuple[float, str]:
    try:
        created, sid = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(sid)
    except (ValueError, TypeError):
        raise ApiError(400, "invalid nextToken") from None


@router.post("/secrets", status_code=201)
async def create_secret(request: Request, body: NewSecret) -> Response:
    name = check_name(body.name)
    _check_value(body.value)
    _check_metadata(body.metadata)
    try:
        rec = await _store(request).create(name, body.value, body.metadata or {})
    except SecretNameTaken as e:
        raise ApiError(409, str(e)) from None
    return JSONResponse(_view(rec), status_code=201)


@router.get("/secrets")
async def list_secrets(request: Request, limit: int = listing.DEFAULT_LIMIT,
                       nextToken: str | None = None) -> Response:
    if not 1 <= limit <= listing.MAX_LIMIT:
        raise ApiError(400, f"limit must be between 1 and {listing.MAX_LIMIT}")
    rows = await _store(request).page(_after(nextToken) if nextToken else None, limit + 1)
    page = rows[:limit]
    headers = {"X-Next-Token": _cursor(page[-1])} if len(rows) > limit else {}
    return JSONResponse([_view(r) for r in page], headers=headers)


@router.get("/secrets/{id_or_name}")
async def get_secret(request: Request, id_or_name: str) -> Response:
    rec = await _store(request).get(id_or_name)
    if rec is None:
        raise _not_found(id_or_name)
    return JSONResponse(_view(rec))


@router.post("/secrets/{id_or_name}")
async def update_secret(request: Request, id_or_name: str, body: SecretUpdate) -> Response:
    _check_value(body.value)
    _check_metadata(body.metadata)
    rec = await _store(request).update(id_or_name, body.value, body.metadata)
    if rec is None:
        raise _not_found(id_or_name)
    return JSONResponse(_view(rec))


@router.delete("/secrets/{id_or_name}", status_code=204)
async def delete_secret(request: Request, id_or_name: str) -> Response:
    if not await _store(request).delete(id_or_name):
        raise _not_found(id_or_name)
    return Response(status_code=204)
