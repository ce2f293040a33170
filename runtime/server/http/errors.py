"""Errors of the HTTP API: BadRequest (a 4xx with its status) and the error bodies, SGLang's shape
on the native routes and OpenAI's on /v1."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class BadRequest(ValueError):
    """A ValueError with a status code other than 400 (404 unknown model, 413, ...), the field it
    is about, and OpenAI's error code where it is not the status (e.g. "model_not_found")."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def is_openai_path(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_response(
    request: Request,
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    # NOTE: a message may quote user text; a lone surrogate in it could not be sent as UTF-8
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if is_openai_path(request):
        kind = "invalid_request_error" if status < 500 else "internal_error"
        err = {"message": message, "type": kind, "param": param, "code": code or status}
        body: dict[str, Any] = {"error": err}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status, headers=headers)


def describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def add_routing_error_handlers(app: FastAPI) -> None:
    """Starlette's own refusals (404 no such path, 405 method not allowed, ...) and any uncaught
    error (a 500, still logged with its traceback) in the API's error shape, not {"detail"}."""
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        message = f"no such route: {method} {path}"
    elif exc.status_code == 405:
        allowed = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
        message = f"method {method} is not allowed on {path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(request, message, exc.status_code, headers=headers)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request, f"Internal server error: {type(exc).__name__}: {exc}", 500)
