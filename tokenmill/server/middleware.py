"""ASGI middleware: request-body size limit, API-key authentication, the JSON body check,
request-id headers.

All run before a route reads the body: an oversized upload is refused from
its Content-Length, or cut off once a chunked body passes the limit, never
buffered whole; an unauthenticated body is never parsed; and a body FastAPI's
parser must not see (not UTF-8, not JSON, too deep, lone surrogates) is a 400.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from typing import Optional

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import error_body
from tokenmill.server.json_body import BodyProblem, check_json_body

#: the routes open without the API key: probes, and the docs (absent when disabled). Every
#: other path needs the key, so a route added later cannot be left open by forgetting it.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})
#: the docs pages' packaged scripts and styles (fastapi-offline)
PUBLIC_PREFIXES = ("/static-offline-docs/",)


def route_path(scope: Scope) -> str:
    """The path the app routes on: without the proxy prefix (``root_path``) where it is there."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _send_error(send: Send, status: int, message: str, param: Optional[str] = None) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the "
                                         f"{self.max_bytes}-byte limit")
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_error(send, 413, f"request body exceeds the {self.max_bytes}-byte limit")


class APIKeyAuth:
    """Bearer-token check in constant time (hmac.compare_digest)."""

    def __init__(self, app: ASGIApp, api_key: Optional[str]) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            await _send_error(send, 401, "invalid or missing API key")
            return
        await self.app(scope, receive, send)


class JSONBodyCheck:
    """Reads a POST body (the size limit runs first) and refuses it unless it is a sound
    JSON object; a sound one is replayed to the route unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                check_json_body(body)
            except BodyProblem as problem:
                await _send_error(send, 400, problem.message, problem.param)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # later reads wait for the disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


#: an X-Request-Id kept as given: visible ASCII, at most 128 characters
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


class RequestIdHeaders:
    """vLLM's ``--enable-request-id-headers``: every response carries ``X-Request-Id``, the
    client's own when it sent a usable one, else a new one. Routes read it from
    ``request.state.request_id`` for their response ids, and log lines in the request's
    context carry it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)
