"""The bad-input corpus against a live `weft serve` on the tiny model: every malformed request gets
its exact 4xx with a message in the API's error shape (never a 5xx), and afterwards the server
still serves, is idle, holds no request and keeps its KV slots conserved."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from corpus_cases import GENERATE, NATIVE_BODY, NATIVE_OTHER, Case
from corpus_openai_cases import CASES as OPENAI_AND_ROUTES
from support import ServerProcess

CASES = [*NATIVE_BODY, *GENERATE, *NATIVE_OTHER, *OPENAI_AND_ROUTES]


@pytest.fixture(scope="module")
def corpus_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("corpus-server") / "serve.log"
    proc = ServerProcess(["--model", str(tiny_model_dir), "--served-model-name", "tiny"], log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(corpus_server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=corpus_server.url, timeout=60) as c:
        yield c


def send(client: httpx.Client, case: Case) -> httpx.Response:
    content = case.raw if case.raw is not None else None
    if content is None and case.body is not None:
        content = json.dumps(case.body).encode()  # NaN and lone surrogates escaped as Python does
    headers = {"content-type": case.content_type} if case.content_type else {}
    return client.request(case.method, case.path, content=content, headers=headers)


def test_the_corpus_is_large_and_named_uniquely() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) >= 150, len(ids)
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_gets_its_4xx_in_the_api_shape(client: httpx.Client, case: Case) -> None:
    resp = send(client, case)
    assert resp.status_code == case.status, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"].strip(), body
    if case.openai:  # OpenAI's nested shape
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error", err
        assert err["code"] in (case.status, "model_not_found"), err
    else:  # SGLang's native shape
        assert set(err) == {"message"}, err
    assert case.says.lower() in err["message"].lower(), (case.says, err["message"])


def test_the_server_is_healthy_and_idle_after_the_corpus(
    client: httpx.Client, corpus_server: Any
) -> None:
    for case in CASES:  # the whole corpus again, as a burst, in case it runs alone
        assert send(client, case).status_code < 500, case.id
    ok = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4, ok.text
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"], chat.text
    stream = client.post(
        "/generate", json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    )
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]"), stream.text
    assert client.get("/health_generate").status_code == 200
    state = client.get("/server_info").json()["internal_states"][0]
    assert state["num_running"] == 0 and state["num_waiting"] == 0, state
    held = state["free_tokens"] + state["evictable_tokens"] + state["protected_tokens"]
    assert held == state["max_total_tokens"] and state["protected_tokens"] == 0, state
    log = Path(corpus_server.log_path).read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
