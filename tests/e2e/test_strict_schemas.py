"""Unenforced schema keywords on a real server: the response header, and per-request strict (400)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

MODEL = "smollm2"
HEADER = "x-weft-unenforced-keywords"
CHAT: Any = [{"role": "user", "content": "Three small numbers as a JSON array."}]
# llguidance enforces everything here but uniqueItems (it reports it; strict refuses it)
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
EXACT = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def fmt(schema: Any, strict: bool | None = None) -> Any:
    spec: dict[str, Any] = {"name": "numbers", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def generate(server: Any, schema: Any, stream: bool = False, **params: Any) -> httpx.Response:
    body = {
        "text": "Numbers: ",
        "sampling_params": {"json_schema": schema, "max_new_tokens": 12, **params},
        "stream": stream,
    }
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def test_native_header_lists_unenforced_keywords(server: Any) -> None:
    resp = generate(server, UNIQUE)
    assert resp.status_code == 200 and resp.headers[HEADER] == "uniqueItems"
    assert resp.json()["meta_info"]["unenforced_keywords"] == ["uniqueItems"]
    streamed = generate(server, UNIQUE, stream=True)  # known before the first byte: sent too
    assert streamed.status_code == 200 and streamed.headers[HEADER] == "uniqueItems"
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert HEADER not in generate(server, EXACT).headers
    assert HEADER not in generate(server, EXACT, stream=True).headers
    batch = httpx.post(
        f"{server.url}/generate",
        json={
            "text": ["A: ", "B: "],
            "sampling_params": [
                {"json_schema": UNIQUE, "max_new_tokens": 4},
                {"json_schema": EXACT, "max_new_tokens": 4},
            ],
        },
        timeout=120,
    )
    assert batch.headers[HEADER] == "uniqueItems"  # the union over the batch


def test_openai_header_on_chat_and_completions(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, response_format=fmt(UNIQUE), max_tokens=12, temperature=0
    )
    assert raw.headers[HEADER] == "uniqueItems"
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=CHAT, response_format=fmt(UNIQUE), max_tokens=12, stream=True
    ) as streamed:
        assert streamed.headers[HEADER] == "uniqueItems"
        assert any(chunk.choices for chunk in streamed.parse())
    done = client.completions.with_raw_response.create(
        model=MODEL, prompt="Numbers:", extra_body={"response_format": fmt(UNIQUE)}, max_tokens=8
    )
    assert done.headers[HEADER] == "uniqueItems"
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, response_format=fmt(EXACT), max_tokens=12, temperature=0
    )
    assert HEADER not in plain.headers


@pytest.mark.parametrize("stream", [False, True])
def test_strict_response_format_refuses_unenforceable_keywords(
    client: openai.OpenAI, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError, match="uniqueItems") as info:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=fmt(UNIQUE, True), stream=stream
        )
    assert "strict" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.completions.create(
            model=MODEL, prompt="Numbers:", extra_body={"response_format": fmt(UNIQUE, True)}
        )
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=fmt(EXACT, True), max_tokens=24, temperature=0
    )
    text = out.choices[0].message.content or ""
    if out.choices[0].finish_reason == "stop":
        assert all(isinstance(x, int) for x in json.loads(text))
    lenient = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=fmt(UNIQUE, False), max_tokens=8
    )
    assert lenient.choices[0].finish_reason in ("stop", "length")


def test_strict_tool_refuses_unenforceable_keywords(client: openai.OpenAI) -> None:
    params = {"type": "object", "properties": {"ids": UNIQUE}, "required": ["ids"]}

    def tools(strict: bool) -> Any:
        fn = {"name": "pick", "parameters": params, "strict": strict}
        return [{"type": "function", "function": fn}]

    named: Any = {"type": "function", "function": {"name": "pick"}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):  # auto: a structural tag
        client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=tools(True), tool_choice="auto", max_tokens=16
        )
    for choice in ("required", named):
        with pytest.raises(openai.BadRequestError, match="uniqueItems"):
            client.chat.completions.create(
                model=MODEL, messages=CHAT, tools=tools(True), tool_choice=choice, max_tokens=16
            )
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=CHAT, tools=tools(False), tool_choice=choice, max_tokens=16
        )
        assert raw.headers[HEADER] == "uniqueItems"


def test_native_strict_flag(server: Any) -> None:
    refused = generate(server, UNIQUE, strict_json_schema=True)
    assert refused.status_code == 400 and "uniqueItems" in refused.json()["error"]["message"]
    streamed = generate(server, UNIQUE, stream=True, strict_json_schema=True)
    assert streamed.status_code == 400 and "uniqueItems" in streamed.json()["error"]["message"]
    assert generate(server, EXACT, strict_json_schema=True).status_code == 200
    bad = httpx.post(
        f"{server.url}/generate",
        json={"text": "x", "sampling_params": {"regex": "a+", "strict_json_schema": True}},
        timeout=60,
    )
    assert bad.status_code == 400 and "needs a json_schema" in bad.json()["error"]["message"]


def test_disconnect_before_the_first_event_aborts(server: Any) -> None:
    """A stream is held until its first event: a client gone by then leaves nothing running."""
    body = {
        "input_ids": [1] + [28] * 3000,  # a prefill of seconds on CPU
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/generate", json=body, timeout=2)
    deadline = time.monotonic() + 60
    while True:
        state = httpx.get(f"{server.url}/server_info", timeout=60).json()["internal_states"][0]
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"the request still runs after the client left: {state}"
        time.sleep(0.2)
