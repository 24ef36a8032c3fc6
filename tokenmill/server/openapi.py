"""The OpenAPI schema as tokenmill answers: OpenAI's 400 error envelope instead of FastAPI's 422,
and the streamed chunk models, which no route returns as JSON, among the components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenmill.server.responses import ErrorResponse

_REF = "#/components/schemas/{model}"

#: the error statuses every route may answer, with what each means
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A bad value, body or field; `param` names it."},
    401: {"model": ErrorResponse, "description": "A missing or wrong API key."},
    404: {"model": ErrorResponse, "description": "An unknown model, adapter or route."},
    413: {"model": ErrorResponse, "description": "The body is over max_request_body_bytes."},
    500: {"model": ErrorResponse, "description": "This request failed inside the engine; the engine "
                                                 "serves on, and the message names the request."},
    503: {"model": ErrorResponse, "description": "The waiting queue is full, the server is draining, "
                                                 "or the engine stopped (see /health)."},
}


def streamed(chunk: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a route that streams ``chunk`` models when ``stream`` is true: each
    server-sent event (the schema describes one event, as OpenAPI before 3.2 reads it) carries a
    ``chunk`` as JSON in its ``data`` (``contentSchema``: an annotation, since the last event's
    data, ``[DONE]``, is no JSON)."""
    return {200: {"description": f"{what}; with `stream: true`, server-sent events instead",
                  "content": {"text/event-stream": {"schema": {
                      "type": "object",
                      "description": f"Each event is `data: <{chunk.__name__} JSON>`; an error after the "
                                     "stream started is an `event: error` with an ErrorResponse; the last "
                                     "event is `data: [DONE]`.",
                      "properties": {"data": {"type": "string",
                                              "contentSchema": {"$ref": _REF.format(model=chunk.__name__)}},
                                     "event": {"type": "string"}},
                      "required": ["data"],
                  }}}}}


def install_openapi(app: FastAPI, extra_models: list[type[BaseModel]]) -> None:
    """Replace ``app.openapi`` with the schema tokenmill serves (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, extra_models)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build(app: FastAPI, extra_models: list[type[BaseModel]]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)  # answered as a 400, declared there
            for status in map(str, ERROR_RESPONSES):
                # errors are JSON even where the route's own answer is not (/metrics)
                content = responses.get(status, {}).get("content", {})
                if content and "application/json" not in content:
                    responses[status]["content"] = {"application/json": content.popitem()[1]}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    _, definitions = models_json_schema([(model, "serialization") for model in extra_models], ref_template=_REF)
    for name, definition in definitions.get("$defs", {}).items():
        components.setdefault(name, definition)
    return schema
