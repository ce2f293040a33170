"""Errors of the HTTP API: BadRequest (a 4xx with its status) and the error bodies, SGLang's shape
on the native routes and OpenAI's on /v1."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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
    request: Request, message: str, status: int, param: str | None = None, code: str | None = None
) -> JSONResponse:
    if is_openai_path(request):
        kind = "invalid_request_error" if status < 500 else "internal_error"
        err = {"message": message, "type": kind, "param": param, "code": code or status}
        body: dict[str, Any] = {"error": err}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"
