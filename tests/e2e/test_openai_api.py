"""The OpenAI API (/v1) on a real `weft serve`, through the official openai client and raw httpx."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

MODEL = "smollm2"
PROMPT = "The capital of France is"
CHAT: Any = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
# Flip to True when constrained decoding (json_schema / regex / ebnf) lands: the test below then
# checks that the output follows the schema instead of the 400 it documents today.
GRAMMARS_AVAILABLE = True


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


def chat_prompt_len(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return len(tokenizer.encode(text, add_special_tokens=False))


def matched_stop(choice: Any) -> Any:
    """weft's (and SGLang's) extra choice field, kept by the openai client in model_extra."""
    return (choice.model_extra or {})["matched_stop"]


def post(server: Any, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_models_list_and_card(server: Any, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    assert card["object"] == "model" and card["max_model_len"] == 8192
    missing = httpx.get(f"{server.url}/v1/models/nope")
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "The model 'nope' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)
    assert client.completions.create(model="default", prompt=PROMPT, max_tokens=1).choices


def test_completion_stream_equals_non_stream(client: openai.OpenAI, tokenizer: Any) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and len(full.choices) == 1
    choice = full.choices[0]
    assert choice.finish_reason == "length" and matched_stop(choice) is None
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.completion_tokens == 8 == len(tokenizer.encode(choice.text))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        8,
    )
    # SGLang's extensions ride in extra_body: top_k=1 is greedy at any temperature
    top1 = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"top_k": 1, "min_p": 0.0}
    )
    assert choice.text.startswith(top1.choices[0].text)


def test_chat_stream_equals_non_stream_with_n2(client: openai.OpenAI, tokenizer: Any) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    message = full.choices[0].message
    assert full.object == "chat.completion" and message.role == "assistant" and message.content
    assert full.usage is not None
    assert full.usage.prompt_tokens == chat_prompt_len(tokenizer, CHAT)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    by_index: dict[int, list[Any]] = {0: [], 1: []}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        by_index[c.index].append(c)
    for chunks in by_index.values():
        first, *middle, end = chunks
        assert first.delta.role == "assistant" and first.delta.content == ""
        assert "".join(c.delta.content for c in middle) == message.content
        assert all(c.finish_reason is None for c in [first, *middle])
        assert end.delta.content is None and end.finish_reason == full.choices[0].finish_reason
    assert usage is not None
    assert usage.prompt_tokens == full.usage.prompt_tokens  # counted once, not n times
    assert usage.completion_tokens == 2 * full.usage.completion_tokens


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample() -> Any:
        return client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=4, n=2, seed=7, temperature=1.0
        )

    one, two = sample(), sample()
    assert [c.index for c in one.choices] == [0, 1]
    assert [c.text for c in one.choices] == [c.text for c in two.choices]  # seeded
    assert one.usage is not None
    assert one.usage.completion_tokens == 8
    assert one.usage.prompt_tokens == 4  # the prompt once, not n times


def test_completion_prompt_forms(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL, prompt=[ids, ids[:2]], max_tokens=3, temperature=0, echo=True
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == PROMPT + by_text.choices[0].text
    assert batch.usage is not None and batch.usage.prompt_tokens == len(ids) + 2
    words = client.completions.create(
        model=MODEL, prompt=["a", "b c"], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert len(words.choices) == 2 and words.usage is not None
    assert words.usage.prompt_tokens == 3 and words.usage.completion_tokens == 4


def test_stop_and_matched_stop(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=["."]
    )
    choice = out.choices[0]
    assert choice.text == " Paris" and choice.finish_reason == "stop"
    assert matched_stop(choice) == "."
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    end = chat.choices[0]
    assert end.finish_reason == "stop"
    assert matched_stop(end) == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_completion_logprobs_and_echo(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top, key=top.__getitem__) == token  # greedy: the top-1 is the chosen token
        assert top[token] == pytest.approx(logprob) and len(top) == 3
    echo = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    choice = echo.choices[0]
    assert choice.text == PROMPT + out.choices[0].text
    elp = choice.logprobs
    assert elp is not None and elp.token_logprobs and elp.top_logprobs and elp.text_offset
    n_prompt = len(tokenizer.encode(PROMPT))
    assert len(elp.tokens or []) == n_prompt + 4
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(x is not None for x in elp.token_logprobs[1:])
    assert elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert elp.text_offset[:2] == [0, len(elp.tokens[0])]


def test_chat_logprobs_bytes(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []).decode("utf-8") == entry.token
    # a byte-level token holding half of a character: its bytes are the raw bytes, not U+FFFD
    half = tokenizer.convert_tokens_to_ids("Ġâ")  # " " + the first byte of a 3-byte character
    forced = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=1,
        logprobs=True,
        logit_bias={str(half): 100},
    )
    entry = forced.choices[0].logprobs.content[0]  # type: ignore[union-attr,index]
    assert entry.bytes == [0x20, 0xE2]


def test_cached_tokens_on_repeat(client: openai.OpenAI) -> None:
    prompt = f"{uuid.uuid4().hex} is a fresh prompt that the radix cache has not seen before"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == second.usage.prompt_tokens - 1
    before = first.usage.prompt_tokens_details
    assert before is None or (before.cached_tokens or 0) < details.cached_tokens


def test_tools_are_accepted(client: openai.OpenAI, tokenizer: Any) -> None:
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice="auto", max_tokens=2
    )
    assert out.usage is not None
    assert out.usage.prompt_tokens == chat_prompt_len(tokenizer, CHAT, tools=tools)
    # required / named tool_choice compile to a json_schema constraint on the arguments
    forced = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice="required", max_tokens=48
    )
    assert forced.choices[0].finish_reason in ("stop", "tool_calls", "length")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_json_schema(client: openai.OpenAI, endpoint: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}

    def call() -> str:
        if endpoint == "chat":
            chat = client.chat.completions.create(
                model=MODEL, messages=CHAT, response_format=fmt, max_tokens=32, temperature=0
            )
            return chat.choices[0].message.content or ""
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"response_format": fmt}, max_tokens=32
        )
        return out.choices[0].text

    if GRAMMARS_AVAILABLE:
        assert isinstance(json.loads(call())["answer"], int)
    else:
        with pytest.raises(openai.BadRequestError, match="constrained decoding .* not available"):
            call()


def test_stream_disconnect_aborts(server: Any) -> None:
    body = _chat(max_tokens=200, stream=True, messages=[{"role": "user", "content": "A story:"}])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the role chunk: the request is running
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = httpx.get(f"{server.url}/server_info", timeout=10).json()["internal_states"][0]
        if state["num_running"] == 0 and state["num_waiting"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the request still runs after the client left: {state}")


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 1, **kw}


def _cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **kw}


C, CHATP = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS: list[tuple[str, Any, str]] = [
    (C, b"prompt=Hi", "content-type must be application/json"),
    (C, b'{"prompt": "Hi",', "malformed json"),
    (C, [1, 2], "must be a json object"),
    (C, {"model": MODEL, "max_tokens": 1}, "prompt is required"),
    (C, _cmpl(prompt=""), "prompt cannot be empty"),
    (C, _cmpl(prompt=["Hi", 3]), "prompt must be a string"),
    (C, _cmpl(max_tokens=0), "max_tokens"),
    (C, _cmpl(logprobs=21), "logprobs"),
    (C, _cmpl(n=0), "n:"),
    (C, _cmpl(temperature="hot"), "temperature"),
    (C, _cmpl(top_p=1.5), "top_p"),
    (C, _cmpl(frobnicate=True), "unknown field 'frobnicate'"),
    (C, _cmpl(prompt="word " * 9000), "longer than the model's context length"),
    (C, _cmpl(prompt=[49152]), "out-of-vocabulary"),
    (C, _cmpl(logit_bias={"99999": 1.0}), "logit_bias"),
    (C, _cmpl(suffix="!"), "suffix"),
    (CHATP, _chat(messages=[]), "messages cannot be empty"),
    (CHATP, _chat(messages=[{"role": "robot", "content": "hi"}]), "role"),
    (CHATP, _chat(max_completion_tokens=100_000), "max_completion_tokens is too large"),
    (CHATP, _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHATP, _chat(response_format={"type": "json_schema"}), "needs a schema"),
    (CHATP, _chat(tool_choice="required"), "tool_choice"),
    (CHATP, _chat(stream_options={"include_usage": True}), "stream_options"),
    (CHATP, _chat(stop=5), "stop must be a string or a list of strings"),
    (CHATP, _chat(frequency_penalty=3), "frequency_penalty"),
    (CHATP, _chat(seed="abc"), "seed"),
    (CHATP, _chat(functions=[{"name": "f"}]), "functions"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_REQUESTS, ids=[b[2] for b in BAD_REQUESTS])
def test_bad_request(server: Any, client: openai.OpenAI, path: str, body: Any, needle: str) -> None:
    if isinstance(body, bytes):
        ctype = "text/plain" if needle.startswith("content-type") else "application/json"
        resp = httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": ctype}, timeout=60
        )
    else:
        resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert needle in error["message"].lower(), error["message"]
    after = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert after.choices[0].finish_reason in ("length", "stop")
