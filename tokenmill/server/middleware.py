"""ASGI middleware: request-body size limit and API-key authentication.

Both run before a route reads the body: an oversized upload is refused from
its Content-Length, or cut off once a chunked body passes the limit, never
buffered whole.
"""

from __future__ import annotations

import hmac
import json
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import error_body

#: routes that need the API key (health, version and metrics stay open for probes)
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
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
        if self.key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS" \
                or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            await _send_error(send, 401, "invalid or missing API key")
            return
        await self.app(scope, receive, send)
