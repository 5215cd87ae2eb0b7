"""OpenAI's error envelope, ``{"error": {"message", "type", "param", "code"}}``, on the routes that speak its API.

``OpenAIRoute`` (a router's ``route_class``) answers every refusal of its routes in that envelope: Ferry's own
errors (``ApiError``, an unknown job, a refused transition) and a request FastAPI could not validate. A refused
request is a 400, as OpenAI answers one; the ``code`` is Ferry's (``invalid_spec``, ``does_not_fit``, ...).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.errors import ApiError, database_busy, error_response
from service.api.openai.create import request_param
from service.queue.db import is_locked
from service.queue.status import IllegalTransition
from service.queue.store import JobNotFound

# What OpenAI calls each kind of refusal.
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# A spec path that names what the request set, as the request's parameter.
_PARAMS = {
    "data.path": "training_file",
    "eval.path": "validation_file",
    "model.path": "model",
    "data.tokenizer.path": "model",
    "training.epochs": "hyperparameters.n_epochs",
    "training.batch_size": "hyperparameters.batch_size",
    "training.learning_rate": "hyperparameters.learning_rate_multiplier",
    "training.seed": "seed",
}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """Every refusal on the OpenAI-compatible routes."""

    error: OpenAIErrorDetail


def openai_error(status_code: int, message: str, *, code: str | None, param: str | None = None) -> Response:
    status_code = 400 if status_code == 422 else status_code
    kind = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(json.dumps(body, ensure_ascii=True), status_code=status_code, media_type="application/json")


OPENAI_PREFIX = "/v1/fine_tuning"  # the routes that speak OpenAI's API, and so its envelope


def is_openai_path(path: str) -> bool:
    """True for a path under the OpenAI-compatible routes: refused there (401, 403, 413) in OpenAI's envelope."""
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


def envelope_for(
    path: str, status_code: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    """A refusal made before any route runs (the access and body-size layers), in the envelope of ``path``'s
    route family: OpenAI's under ``OPENAI_PREFIX``, Ferry's elsewhere."""
    if not is_openai_path(path):
        return error_response(status_code, code, message, headers=headers)
    response = openai_error(status_code, message, code=code)
    response.headers.update(headers or {})
    return response


def install_openai_http_errors(app: FastAPI) -> None:
    """Starlette's own refusals (404 for a path no route has, 405 for a method the route lacks) under
    ``OPENAI_PREFIX`` in OpenAI's envelope, ``Allow`` kept; elsewhere Ferry's handler answers as before.
    Call after ``install_error_handlers``: this one wraps the handler that installed."""
    ferry = app.exception_handlers[StarletteHTTPException]

    async def answer(request: Request, error: Exception) -> Response:
        if not isinstance(error, StarletteHTTPException) or not is_openai_path(request.scope["path"]):
            return await ferry(request, error)
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        message = {
            404: f"No route {request.scope['path']}; the fine-tuning routes are under {OPENAI_PREFIX}/jobs.",
            405: f"{request.method} is not allowed on {request.scope['path']}"
            + (f"; use {error.headers['Allow']}." if error.headers and "Allow" in error.headers else "."),
        }.get(error.status_code, str(error.detail))
        response = openai_error(error.status_code, message, code=code)
        response.headers.update(error.headers or {})
        return response

    app.add_exception_handler(StarletteHTTPException, answer)


def param_of(problems: list[dict[str, Any]] | None) -> str | None:
    """The request parameter behind the first spec problem: a spec path the request set, else ``ferry.<path>``."""
    if not problems:
        return None
    path = str(problems[0].get("path") or "")
    if path.startswith("@"):  # a request parameter itself (create.request_error)
        return path[1:]
    return _PARAMS.get(path) or (f"ferry.{path}" if path else None)


class OpenAIRoute(APIRoute):
    """A route whose refusals are OpenAI's error envelope."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as error:
                response = openai_error(
                    error.status_code, error.message, code=error.code, param=param_of(error.problems)
                )
                response.headers.update(error.headers or {})
                return response
            except JobNotFound as error:
                return openai_error(404, str(error), code="not_found")
            except IllegalTransition as error:
                return openai_error(409, str(error), code="illegal_transition")
            except sqlite3.OperationalError as error:
                if not is_locked(error):
                    raise
                busy = database_busy()
                response = openai_error(busy.status_code, busy.message, code=busy.code)
                response.headers.update(busy.headers or {})
                return response
            except RequestValidationError as error:
                first = error.errors()[0]
                param = request_param(first["loc"][1:])
                return openai_error(400, f"{param or 'request'}: {first['msg']}", code="invalid_request", param=param)

        return answer
