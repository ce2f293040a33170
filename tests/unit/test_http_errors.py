"""The app's own refusals without a runtime: 404, 405 and an uncaught error in the API's error
shape (SGLang's on native routes, OpenAI's on /v1), and a body too deep refused before a route."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from weft.runtime.server.http.app import create_app
from weft.runtime.server.http.state import ServerConfig


@pytest.fixture(scope="module")
def client() -> Any:
    app = create_app(ServerConfig(), start=False)

    async def boom() -> None:
        raise TypeError("a bug")

    app.add_api_route("/boom", boom)
    app.add_api_route("/v1/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        ("GET", "/nope", 404, "no such route: GET /nope"),
        ("GET", "/generate", 405, "method GET is not allowed on /generate (allowed: POST, PUT)"),
        ("GET", "/boom", 500, "Internal server error: TypeError: a bug"),
    ],
)
def test_native_refusals(client: Any, method: str, path: str, status: int, message: str) -> None:
    resp = client.request(method, path)
    assert resp.status_code == status and resp.json() == {"error": {"message": message}}


@pytest.mark.parametrize(
    ("method", "path", "status", "kind"),
    [
        ("GET", "/v1/nope", 404, "invalid_request_error"),
        ("DELETE", "/v1/completions", 405, "invalid_request_error"),
        ("GET", "/v1/boom", 500, "internal_error"),
    ],
)
def test_openai_refusals(client: Any, method: str, path: str, status: int, kind: str) -> None:
    resp = client.request(method, path)
    err = resp.json()["error"]
    assert resp.status_code == status and err["type"] == kind and err["code"] == status, err
    assert err["message"] and err["param"] is None


def test_405_keeps_the_allow_header(client: Any) -> None:
    assert client.get("/v1/completions").headers["allow"] == "POST"


def test_a_deep_body_is_a_400_before_the_runtime_is_needed(client: Any) -> None:
    resp = client.post("/generate", content=b"[" * 50_000 + b"]" * 50_000)
    assert resp.status_code == 400 and "deeper than 128" in resp.json()["error"]["message"]
