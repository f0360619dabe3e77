"""E2B-shaped errors: every non-2xx answer of the REST API is ``{"code", "message"}`` JSON.

The SDK's generated client parses error bodies with ``Error.from_dict`` and turns anything
else (plain text, a missing key) into a raw exception, so no path may answer otherwise —
validation failures, unknown routes, oversized bodies and failures included.

What no handler takes reaches ``_Boundary``, the innermost user middleware: the traceback is
logged once, with the request's method and path, and the client gets a 5xx naming only the
exception's type — never its text, which carries host paths, argv and stderr. Host-side
families (``HOST_FAULTS``: storage, network, VM runtime) are the node's fault, so a 5xx
that says which part failed, never a 400, even when one is also a ``ValueError``; anything
else is ``500 internal error: <ExcType>``. The boundary answers instead of re-raising,
because Starlette's ``ServerErrorMiddleware`` (where a handler for plain ``Exception``
lives) re-raises after answering, so the server would log the trace again and in-process
clients would see an exception instead of the answer. The same answer is also installed
there, for what fails outside the boundary.

An ``OrchestratorError`` of 5xx that wraps a host error (``raise StartFailed(f"...: {e}")
from e``) keeps its own words, but the wrapped error's text in them is replaced by that
error's family and type, for the same reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..network.errors import NetworkError, PoolClosedError, PoolExhaustedError
from ..orchestrator.errors import LimitReached, OrchestratorError
from ..runtime.base import NotSupportedError, VMError
from ..storage.errors import StorageError
from ..store.secrets import SecretsUnavailable
from ..store.templates import NameTaken

log = logging.getLogger(__name__)

# (family, status, what the client is told), first match wins: subclasses before bases.
HOST_FAULTS: tuple[tuple[type[Exception], int, str], ...] = (
    (PoolExhaustedError, 503, "no network slot is free on this node"),
    (PoolClosedError, 503, "the server is shutting down"),
    (SecretsUnavailable, 503, "the cluster's secret store (Redis) is unreachable"),
    (NetworkError, 500, "host network failure"),
    (NotSupportedError, 501, "this node's VM runtime cannot do that"),
    (VMError, 500, "VM runtime failure"),
    (StorageError, 500, "host storage failure"),
)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry


def error_response(status: int, message: str, *, retry: bool | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    hdrs = dict(headers or {})
    if retry is not None:
        hdrs["Should-Retry"] = "true" if retry else "false"
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=hdrs)


def _fault(exc: BaseException) -> tuple[int, str]:
    """(status, what the client may read) of an error: its family and type, no text."""
    name = type(exc).__name__
    for family, status, what in HOST_FAULTS:
        if isinstance(exc, family):
            return status, f"{what} ({name})"
    return 500, f"internal error: {name}"


def failure_response(exc: Exception) -> JSONResponse:
    """The answer to an exception no handler took: its family's 5xx, or a plain 500."""
    status, message = _fault(exc)
    return error_response(status, message, retry=False)


def _public_message(exc: OrchestratorError) -> str:
    cause = exc.__cause__
    if exc.status < 500 or cause is None or not str(cause):
        return exc.message
    return exc.message.replace(str(cause), _fault(cause)[1])


def public_error(exc: Exception) -> tuple[int, str]:
    """(code, message) of ``exc`` as an answer would carry them, for a route that reports
    errors inside a 2xx body (a fork's failed children)."""
    if isinstance(exc, OrchestratorError):
        return exc.status, _public_message(exc)
    if isinstance(exc, ApiError):
        return exc.status, exc.message
    return _fault(exc)


class _Boundary:
    """Log and answer (``failure_response``) what escaped every exception handler."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                # Part of an answer is out: only the server can end it, by cutting the
                # connection (and it logs the trace).
                raise
            log.exception("%s %s failed: %s", scope["method"], scope["path"],
                          type(exc).__name__)
            await failure_response(exc)(scope, receive, send)


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        if err.get("type") == "json_invalid":
            return "request body is not valid JSON"
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, retry=exc.retry)

    @app.exception_handler(OrchestratorError)
    async def _orch(_: Request, exc: OrchestratorError) -> JSONResponse:
        # Failures after side effects must not be retried by the SDK (it retries POSTs).
        retry = exc.status == 429
        headers = ({"Retry-After": str(exc.retry_after)} if isinstance(exc, LimitReached)
                   else None)
        return error_response(exc.status, _public_message(exc), retry=retry, headers=headers)

    @app.exception_handler(NameTaken)
    async def _name_taken(_: Request, exc: NameTaken) -> JSONResponse:
        # A template or snapshot name is the client's to choose: another one is free.
        return error_response(409, str(exc), retry=False)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe(exc), retry=False)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    # ServerErrorMiddleware's handler: answers what failed outside the boundary, then
    # re-raises it for the server to log.
    @app.exception_handler(Exception)
    async def _outside(_: Request, exc: Exception) -> JSONResponse:
        return failure_response(exc)

    app.add_middleware(_Boundary)
