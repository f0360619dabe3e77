"""Control-plane volume routes (spec-2 section 4.1): ``POST/GET/DELETE /volumes[/{id}]``.

``VolumeAndToken`` carries the bearer token of the content API; no ``domain`` is returned,
so the SDK sends content calls to ``E2B_VOLUME_API_URL``, which is this same listener
(``volume_content``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from ..orchestrator.volumes import Volumes
from ..store.volumes import VolumeRecord
from .errors import ApiError
from .models import _Body

router = APIRouter()


class NewVolume(_Body):
    name: str = Field(min_length=1, max_length=128)
    # aenv extension: a smaller quota than AENV_VOLUME_SIZE_MB (the default and the most).
    sizeMB: int | None = Field(default=None, ge=16)


def volumes(request: Request) -> Volumes:
    v: Volumes | None = getattr(request.app.state, "volumes", None)
    if v is None:
        raise ApiError(501, "volumes are not enabled on this server")
    return v


def and_token(rec: VolumeRecord) -> dict[str, Any]:
    return {"volumeID": rec.id, "name": rec.name, "token": rec.token}


@router.post("/volumes")
async def create(request: Request, body: NewVolume) -> Response:
    rec = await volumes(request).create(body.name, body.sizeMB)
    return JSONResponse(and_token(rec), status_code=201)


@router.get("/volumes")
async def list_volumes(request: Request) -> Response:
    return JSONResponse([{"volumeID": r.id, "name": r.name} for r in volumes(request).all()])


@router.get("/volumes/{volume_id}")
async def get(request: Request, volume_id: str) -> Response:
    return JSONResponse(and_token(volumes(request).get(volume_id)))


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete(request: Request, volume_id: str) -> Response:
    await volumes(request).delete(volume_id)
    return Response(status_code=204)
