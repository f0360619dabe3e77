"""The JSON error body every envd HTTP endpoint answers with: ``{"code": int, "message": str}``."""

from __future__ import annotations

from starlette.responses import JSONResponse


def json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"code": status, "message": message},
        status_code=status,
        media_type="application/json; charset=utf-8",
    )
