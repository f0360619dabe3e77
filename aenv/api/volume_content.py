"""The volume content API (spec-2 section 4.2) under ``/volumecontent/{volumeID}/...``.

It shares the server's listener (the SDKs read ``E2B_VOLUME_API_URL``; point it at the
server) but not the REST API's rules, so ``mount`` puts it in front of them: auth is the
volume's own bearer token (``Authorization: Bearer``), never the API key; error bodies carry
a *string* ``code``; success codes are exact (201 for ``PUT file`` and ``POST dir``, 204 for
``DELETE path``); and uploads are not held to the REST API's 1 MiB body limit — they stream
to a temporary file chunk by chunk and are bounded only by the volume's size (its quota).
Path handling, including why nothing escapes the volume, is ``storage.volume_fs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..orchestrator.errors import OrchestratorError
from ..orchestrator.volumes import Volumes
from ..storage.volume_fs import PathError, Volume, parts

log = logging.getLogger(__name__)

PREFIX = "/volumecontent/"
CHUNK = 1024 * 1024
MAX_DEPTH = 32

Handler = Callable[[Request, Volume], Coroutine[Any, Any, Response]]


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status)


class _Bad(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _int(request: Request, key: str, *, low: int = 0, high: int = 2**32 - 1) -> int | None:
    raw = request.query_params.get(key)
    if raw is None or raw == "":
        return None
    try:
        v = int(raw, 10)
    except ValueError:
        raise _Bad(f"{key} must be a decimal integer") from None
    if not low <= v <= high:
        raise _Bad(f"{key} must be between {low} and {high}")
    return v


def _force(request: Request) -> bool:
    raw = request.query_params.get("force", "false").lower()
    if raw not in ("true", "false"):
        raise _Bad("force must be true or false")
    return raw == "true"


def _path(request: Request) -> list[str]:
    raw = request.query_params.get("path")
    if not raw:
        raise _Bad("the path query parameter is required")
    return parts(raw)


def _mode(request: Request) -> int | None:
    return _int(request, "mode", high=0o7777)


# -- handlers, one per (method, resource) ---------------------------------------------------


async def list_dir(request: Request, vol: Volume) -> Response:
    depth = _int(request, "depth", low=1, high=MAX_DEPTH) or 1
    return JSONResponse(await asyncio.to_thread(vol.entries, _path(request), depth))


async def make_dir(request: Request, vol: Volume) -> Response:
    out = await asyncio.to_thread(
        vol.make_dir, _path(request), mode=_mode(request), uid=_int(request, "uid"),
        gid=_int(request, "gid"), force=_force(request))
    return JSONResponse(out, status_code=201)


async def get_info(request: Request, vol: Volume) -> Response:
    return JSONResponse(await asyncio.to_thread(vol.info, _path(request)))


async def update(request: Request, vol: Volume) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise _Bad("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _Bad("request body must be a JSON object")
    values: dict[str, int | None] = {}
    for key, high in (("uid", 2**32 - 1), ("gid", 2**32 - 1), ("mode", 0o7777)):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not 0 <= v <= high):
            raise _Bad(f"{key} must be an integer between 0 and {high}")
        values[key] = v
    out = await asyncio.to_thread(vol.update, _path(request), **values)
    return JSONResponse(out)


async def remove(request: Request, vol: Volume) -> Response:
    await asyncio.to_thread(vol.remove, _path(request))
    return Response(status_code=204)


async def read_file(request: Request, vol: Volume) -> Response:
    fd = await asyncio.to_thread(vol.open_read, _path(request))
    size = os.fstat(fd).st_size

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while data := await asyncio.to_thread(os.read, fd, CHUNK):
                yield data
        finally:
            os.close(fd)

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"Content-Length": str(size)})


async def write_file(request: Request, vol: Volume) -> Response:
    components = _path(request)
    mode, uid, gid, force = _mode(request), _int(request, "uid"), _int(request, "gid"), \
        _force(request)
    upload = await asyncio.to_thread(vol.begin_write, components)
    try:
        pending: list[bytes] = []
        held = 0
        async for chunk in request.stream():
            pending.append(chunk)
            held += len(chunk)
            if held >= CHUNK:
                await asyncio.to_thread(upload.write, b"".join(pending))
                pending, held = [], 0
        if pending:
            await asyncio.to_thread(upload.write, b"".join(pending))
        out = await asyncio.to_thread(upload.commit, mode=mode, uid=uid, gid=gid, force=force)
    finally:
        await asyncio.to_thread(upload.abort)
    return JSONResponse(out, status_code=201)


ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "dir"): list_dir,
    ("POST", "dir"): make_dir,
    ("GET", "path"): get_info,
    ("PATCH", "path"): update,
    ("DELETE", "path"): remove,
    ("GET", "file"): read_file,
    ("PUT", "file"): write_file,
}


class VolumeContent:
    """ASGI app of the content API; ``mount`` sends it the ``/volumecontent/`` paths."""

    def __init__(self, volumes: Volumes) -> None:
        self.volumes = volumes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        response = await self._answer(request)
        await response(scope, receive, send)

    async def _answer(self, request: Request) -> Response:
        segments = request.url.path[len(PREFIX):].split("/")
        if len(segments) != 2 or not segments[0]:
            return _error(404, "not_found", "no such volume content route")
        volume_id, resource = segments
        handler = ROUTES.get((request.method, resource))
        if handler is None:
            if any(r == resource for _, r in ROUTES):
                return _error(405, "method_not_allowed", f"{request.method} is not allowed")
            return _error(404, "not_found", "no such volume content route")
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        rec = self.volumes.store.get(volume_id)
        if (not token or rec is None or rec.state != "ready"
                or not rec.token_matches(token)):
            return _error(401, "unauthorized", "missing or invalid volume token")
        try:
            vol = await self.volumes.content(volume_id)
            return await handler(request, vol)
        except _Bad as e:
            return _error(400, "bad_request", e.message)
        except PathError as e:
            return _error(e.status, e.code, e.message)
        except OrchestratorError as e:
            return _error(e.status, "error", e.message)
        except Exception as e:  # the REST API's boundary is behind this app: answer here
            log.exception("%s %s failed", request.method, request.url.path)
            return _error(500, "internal", f"internal error: {type(e).__name__}")


def mount(app: ASGIApp, volumes: Volumes) -> ASGIApp:
    """``app`` with the content API in front of it for ``/volumecontent/`` paths."""
    content = VolumeContent(volumes)

    async def front(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await content(scope, receive, send)
        else:
            await app(scope, receive, send)

    return front
