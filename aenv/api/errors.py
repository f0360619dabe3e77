"""E2B-shaped errors: every non-2xx answer of the REST API is ``{"code", "message"}`` JSON.

The SDK's generated client parses error bodies with ``Error.from_dict`` and turns anything
else (plain text, a missing key) into a raw exception, so no path may answer otherwise —
validation failures, unknown routes and oversized bodies included.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from ..orchestrator.errors import OrchestratorError


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry


def error_response(status: int, message: str, *, retry: bool | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    hdrs = dict(headers or {})
    if retry is not None:
        hdrs["Should-Retry"] = "true" if retry else "false"
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=hdrs)


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
        return error_response(exc.status, exc.message, retry=retry)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _describe(exc), retry=False)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)
