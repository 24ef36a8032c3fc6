"""ASGI middleware for ``--middleware`` tests: one class, one HTTP middleware function, each
marking the responses it saw with a header."""

from __future__ import annotations


class TagResponses:
    """ASGI middleware (a class): adds ``x-tagged-by: class``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-tagged-by", b"class")]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def count_requests(request, call_next):
    """An HTTP middleware (a function): adds ``x-seen: yes``."""
    response = await call_next(request)
    response.headers["x-seen"] = "yes"
    return response


NOT_MIDDLEWARE = 42
