"""The OpenAI error envelope for every failure: ``{"error": {message, type, param, code}}``.

No traceback ever reaches a client: unexpected exceptions are logged with
their stack and answered with a generic 500.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Optional

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.core.engine.async_llm import EngineDead, EngineOverloaded, RequestFailed
from tokenmill.core.engine.rollout import EngineAsleep
from tokenmill.interfaces.errors import DeviceFailed, InvalidRequest

log = structlog.get_logger("tokenmill.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "internal_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union it tried ("str", "list[int]") inside ``loc``."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none"})


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, Optional[str]]:
    """The first problem as (message, dotted parameter)."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(loc) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


def api_error_from(exc: Exception) -> APIError:
    """Map known exceptions to an APIError; anything else is an internal error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return APIError(400, *validation_message(exc))
    if isinstance(exc, (EngineOverloaded, EngineDead, EngineAsleep, DeviceFailed)):
        return APIError(503, str(exc))
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc))
    log.error("internal error", exc_info=exc)
    return APIError(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        error = api_error_from(exc)
        return error_response(error.status, error.message, error.param)

    async def handle_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)

    for exc_type in (APIError, InvalidRequest, RequestValidationError, ValidationError,
                     EngineOverloaded, EngineDead, RequestFailed, Exception):
        app.add_exception_handler(exc_type, handle)
    app.add_exception_handler(StarletteHTTPException, handle_http)


def sse_error(exc: Exception) -> str:
    """An error after a stream started: an SSE ``error`` event (then the caller sends [DONE])."""
    error = api_error_from(exc)
    return f"event: error\ndata: {json.dumps(error_body(error.status, error.message, error.param))}\n\n"
