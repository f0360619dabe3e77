"""HTTP routes of the code-interpreter server (the wire format of e2b-code-interpreter).

``POST /execute`` takes ``{"code", "context_id"?, "language"?, "env_vars"?}`` (the Python SDK
sends every key, ``null`` when unset; the JS SDK leaves them out) and answers 200 with one
ASCII JSON object per line; ``/contexts`` answers ``{"id", "language", "cwd"}`` objects.

With ``warm_up_port`` the server, once listening, sends itself one ``POST /execute`` over
loopback and answers ``/health`` 503 until that is done. The template's ready check is
``/health``, so the snapshot holds a server and kernel that have run a cell through every
layer (uvicorn's POST path, Starlette's streaming response and the anyio backend it imports
on first use, the env-var fetch, the kernel's display hook): without it a restored
sandbox's first ``run_code`` paid 1-2 s of such first-use work under TCG (issue 19).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .kernels import Context, Kernels, KernelStartFailed, UnknownLanguage, normalise_language

log = logging.getLogger("aenv.interpreter")


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=True) + "\n").encode()


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object")
    return data


WARM_UP_CODE = "1 + 1"


async def _post_to_self(port: int, path: str, body: dict[str, Any]) -> bytes:
    """One HTTP/1.1 request to this server on loopback, retried until it listens; the
    response's raw bytes."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    for _ in range(600):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            await asyncio.sleep(0.1)
    else:
        raise TimeoutError(f"the server did not listen on {port}")
    try:
        writer.write(head + data)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


def create_app(kernels: Kernels, start_languages: tuple[str, ...] = ("python",),
               preload: str | None = None, warm_up_port: int | None = None) -> Starlette:
    warmed = asyncio.Event()
    if warm_up_port is None:
        warmed.set()

    async def warm_up(ctx: Context) -> None:
        started = time.monotonic()
        try:
            kernels.warming = True
            out = await _post_to_self(warm_up_port or 0, "/execute", {"code": WARM_UP_CODE})
            if b'"result"' not in out:
                log.warning("warm-up execution gave no result: %r", out[-500:])
            await kernels.forget_warm_up(ctx)
            log.info("warmed up in %.0f ms", (time.monotonic() - started) * 1000)
        except Exception:
            log.exception("warm-up failed (the server still serves, unwarmed)")
        finally:
            kernels.warming = False
            warmed.set()

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        tasks = []
        for language in start_languages:
            try:
                ctx = await kernels.default(language)
            except UnknownLanguage as exc:
                log.warning("%s", exc)
                continue
            if preload and ctx.language == "python":
                await kernels.preload(ctx, preload)
            if warm_up_port is not None and ctx.language == "python":
                tasks.append(asyncio.create_task(warm_up(ctx)))
        if not tasks:
            warmed.set()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await kernels.shutdown()

    async def health(_: Request) -> Response:
        if not warmed.is_set():
            return PlainTextResponse("warming up", status_code=503)
        return PlainTextResponse("OK")

    async def execute(request: Request) -> Response:
        try:
            body = await _body(request)
        except ValueError as exc:
            return PlainTextResponse(f"invalid body: {exc}", status_code=400)
        code = body.get("code")
        if not isinstance(code, str):
            return PlainTextResponse("code must be a string", status_code=400)
        context_id, language = body.get("context_id"), body.get("language")
        if context_id and language:
            return PlainTextResponse(
                "Only one of context_id or language can be provided", status_code=400)
        envs = body.get("env_vars") or {}
        if not isinstance(envs, dict):
            return PlainTextResponse("env_vars must be an object", status_code=400)
        if context_id:
            ctx = kernels.contexts.get(context_id)
            if ctx is None:
                return PlainTextResponse(f"Context {context_id} not found", status_code=404)
        else:
            try:
                ctx = await kernels.default(language)
            except UnknownLanguage as exc:
                return PlainTextResponse(str(exc), status_code=400)
            except KernelStartFailed as exc:
                return PlainTextResponse(str(exc), status_code=500)
        token = request.headers.get("x-access-token")
        lines = kernels.execute(ctx, code, {str(k): str(v) for k, v in envs.items()}, token)

        async def stream() -> AsyncIterator[bytes]:
            async for line in lines:
                yield _line(line)

        return StreamingResponse(stream(), media_type="application/json")

    async def create_context(request: Request) -> Response:
        try:
            body = await _body(request)
        except ValueError as exc:
            return PlainTextResponse(f"invalid body: {exc}", status_code=400)
        try:
            ctx = await kernels.create(body.get("language"), body.get("cwd"))
        except UnknownLanguage as exc:
            return PlainTextResponse(str(exc), status_code=400)
        except NotADirectoryError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        except KernelStartFailed as exc:
            return PlainTextResponse(str(exc), status_code=500)
        return JSONResponse(ctx.describe())

    async def list_contexts(_: Request) -> Response:
        return JSONResponse([ctx.describe() for ctx in kernels.contexts.values()])

    async def restart_context(request: Request) -> Response:
        ctx = kernels.contexts.get(request.path_params["context_id"])
        if ctx is None:
            return PlainTextResponse("Context not found", status_code=404)
        await kernels.restart(ctx)
        return JSONResponse(None)

    async def remove_context(request: Request) -> Response:
        ctx = kernels.contexts.get(request.path_params["context_id"])
        if ctx is None:
            return PlainTextResponse("Context not found", status_code=404)
        await kernels.remove(ctx)
        return JSONResponse(None)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/execute", execute, methods=["POST"]),
            Route("/contexts", create_context, methods=["POST"]),
            Route("/contexts", list_contexts, methods=["GET"]),
            Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
            Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
        ],
        lifespan=lifespan,
    )


__all__ = ["create_app", "normalise_language"]
