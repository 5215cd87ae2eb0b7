"""One error shape for every 4xx/5xx: ``{"error": {"code", "message", "problems"?}}``."""

from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import ApiError
from service.queue.db import is_locked
from service.queue.status import IllegalTransition
from service.queue.store import JobNotFound

__all__ = [
    "INT64_MAX",
    "ApiError",
    "database_busy",
    "error_response",
    "install_error_handlers",
]  # ApiError: service/errors.py

log = logging.getLogger("ferry.api")
INT64_MAX = 2**63 - 1  # the largest id, cursor or count the store (SQLite INTEGER) holds


class _EnvelopeResponse(JSONResponse):
    """An error answer that always encodes: non-ASCII is escaped (``\\u00b2``), so even a lone surrogate
    echoed from a request cannot turn an error into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


DB_RETRY_AFTER_S = 5  # a database locked by another connection (a backup, a shell): try again about then


def database_busy() -> ApiError:
    """The 503 for a database another connection kept locked past the busy timeout and every retry."""
    return ApiError(
        503,
        "database_busy",
        "The job database is locked by another connection (a backup or an sqlite3 shell?) past "
        "FERRY_DB_BUSY_TIMEOUT_S; nothing was changed: send the request again.",
        headers={"Retry-After": str(DB_RETRY_AFTER_S)},
    )


def error_response(
    status_code: int,
    code: str,
    message: str,
    problems: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if problems is not None:
        body["problems"] = problems
    return _EnvelopeResponse({"error": body}, status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Map domain exceptions to HTTP answers so routes stay short."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error.status_code, error.code, error.message, error.problems, error.headers)

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, error: JobNotFound) -> JSONResponse:
        return error_response(404, "not_found", str(error))

    @app.exception_handler(IllegalTransition)
    async def _conflict(_: Request, error: IllegalTransition) -> JSONResponse:
        return error_response(409, "illegal_transition", str(error))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = [
            {"path": ".".join(str(p) for p in e["loc"]), "message": e["msg"], "line": None, "suggestion": None}
            for e in error.errors()
        ]
        summary = "; ".join(f"{p['path']}: {p['message']}" for p in problems)
        return error_response(422, "invalid_request", f"The request is invalid: {summary}.", problems)

    @app.exception_handler(sqlite3.OperationalError)
    async def _database(request: Request, error: sqlite3.OperationalError) -> JSONResponse:
        if is_locked(error):
            busy = database_busy()
            return error_response(busy.status_code, busy.code, busy.message, headers=busy.headers)
        return await _unexpected(request, error)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=error)
        return error_response(
            500,
            "internal_error",
            f"The server failed to handle the request; its log has the details ({type(error).__name__}).",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return error_response(error.status_code, code, str(error.detail), headers=error.headers)
