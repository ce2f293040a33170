"""The HTTP server's ASGI middlewares: the API key (constant-time), and the guard (request body cap,
503 while shutting down, the count of requests in flight). Plain ASGI: Starlette's
BaseHTTPMiddleware would hide client disconnects from the routes (no abort on disconnect)."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from weft.runtime.server.http.errors import error_response
from weft.runtime.server.http.state import AppState

logger = logging.getLogger("weft.server")

OPEN_PATHS = {"/health"}  # answered without the API key
UNGUARDED_PATHS = {"/health", "/metrics"}  # answered while shutting down, and not counted
SHUTTING_DOWN = "the server is shutting down: it accepts no new requests"


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (OpenAI's header; compared in constant time)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                response = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GuardMiddleware:
    """Refuses a body over `max_bytes` with a 413 (from Content-Length, and while a chunked body
    streams in: the body is read here, then handed on), every request with a 503 once the server
    drains (SIGTERM), and counts the requests in flight (AppState.in_flight) for the drain."""

    def __init__(self, app: Any, state: AppState, max_bytes: int) -> None:
        self.app = app
        self.state = state
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in UNGUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await _error(scope, receive, send, SHUTTING_DOWN, 503)
            return
        self.state.in_flight += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            message = (
                f"the request body is {declared} bytes, more than this server's limit of "
                f"{self.max_bytes} bytes (set by weft serve --max-request-bytes)"
            )
            await _error(scope, receive, send, message, 413)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its request arrived: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                text = (
                    f"the request body is more than this server's limit of {self.max_bytes} "
                    "bytes (set by weft serve --max-request-bytes)"
                )
                await _error(scope, receive, send, text, 413)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Any) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _error(scope: Any, receive: Any, send: Any, message: str, status: int) -> None:
    """The error in the shape of the route's API (OpenAI's on /v1, SGLang's elsewhere)."""
    response = error_response(Request(scope), message, status)
    if status == 413:
        response.headers["Connection"] = "close"  # the rest of the body is not read
    await response(scope, receive, send)
