"""structural_tag on a real server: the openai client's response_format and the native /generate.

A logit bias on the trigger's token makes the packaged model open a tag wherever free text is
allowed, so every output holds several tags; each must hold a value of its schema."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm2"
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TAG: Any = {
    "type": "structural_tag",
    "structures": [{"begin": "@add(", "schema": ADD, "end": ")"}],
    "triggers": ["@"],
}
CHAT: Any = [{"role": "user", "content": "Add some numbers with the @add tool."}]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def at_id(default_model_dir: Any) -> str:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(default_model_dir)).encode(
        "@", add_special_tokens=False
    )
    assert len(ids) == 1
    return str(ids[0])


def check_tags(text: str) -> int:
    """The number of complete tags; every one holds a valid value, and no '@' is outside a tag."""
    parts = text.split("@")
    for part in parts[1:-1]:  # complete tags (the last may be cut by max_tokens)
        assert part.startswith("add(") and part.endswith(")"), (part, text)
        body = part[len("add(") : -1]
        jsonschema.validate(json.loads(body), ADD)
    last = parts[-1]
    assert len(parts) == 1 or last.startswith("add(") or "add(".startswith(last), text
    return len(parts) - 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_openai_response_format_structural_tag(
    client: openai.OpenAI, at_id: str, temperature: float
) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format=TAG,
        logit_bias={at_id: 100},
        max_tokens=64,
        temperature=temperature,
        seed=7,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert check_tags(choice.message.content or "") >= 2


def test_without_the_bias_free_text_has_no_trigger_outside_a_tag(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="Email me at",
        extra_body={"response_format": TAG},
        max_tokens=24,
        temperature=0,
    )
    check_tags(resp.choices[0].text)


def test_native_generate_takes_it_as_a_sampling_parameter(server: Any, at_id: str) -> None:
    params = {"structural_tag": json.dumps(TAG), "max_new_tokens": 48, "temperature": 0}
    body = {"text": "Sum: ", "sampling_params": {**params, "logit_bias": {at_id: 100}}}
    resp = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert check_tags(resp.json()["text"]) >= 2
    as_object = {**body, "sampling_params": {**body["sampling_params"], "structural_tag": TAG}}
    again = httpx.post(f"{server.url}/generate", json=as_object, timeout=120)
    assert again.json()["text"] == resp.json()["text"]


def test_bad_structural_tags_are_400_and_the_server_goes_on(
    server: Any, client: openai.OpenAI
) -> None:
    bad = {**TAG, "triggers": ["#"]}
    with pytest.raises(openai.BadRequestError, match="starts with none of the triggers"):
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=TAG, extra_body={"regex": "a+"}
        )
    body = {
        "text": "x",
        "sampling_params": {"structural_tag": {"structures": [], "triggers": ["@"]}},
    }
    resp = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    assert re.search("structures must be a non-empty", resp.json()["error"]["message"])
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_the_newer_format_form_through_the_openai_client(client: openai.OpenAI) -> None:
    """xgrammar's `format`: tags separated by ';', at least one, nothing else."""
    tag = {"begin": "@add(", "content": {"type": "json_schema", "json_schema": ADD}, "end": ")"}
    fmt = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [tag],
            "separator": ";",
            "at_least_one": True,
        },
    }
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=fmt, max_tokens=80, temperature=0
    )
    text = resp.choices[0].message.content or ""
    calls = text.split(";")
    complete = calls if resp.choices[0].finish_reason == "stop" else calls[:-1]
    assert complete, text
    for part in complete:
        assert part.startswith("@add(") and part.endswith(")"), text
        jsonschema.validate(json.loads(part[len("@add(") : -1]), ADD)
    with pytest.raises(openai.BadRequestError, match="token-level format"):
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format={"type": "structural_tag", "format": {"type": "token", "token": 1}},
        )


def test_streamed_and_n_2_outputs_hold_valid_tags(client: openai.OpenAI, at_id: str) -> None:
    """Streaming deltas add up to a valid text; n=2 choices (matcher copies) each hold tags."""
    common: Any = {"model": MODEL, "messages": CHAT, "response_format": TAG, "max_tokens": 48}
    stream = client.chat.completions.create(
        **common, logit_bias={at_id: 100}, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert check_tags(text) >= 2
    both = client.chat.completions.create(
        **common, logit_bias={at_id: 100}, n=2, temperature=1.0, seed=3
    )
    assert len(both.choices) == 2
    for choice in both.choices:
        assert check_tags(choice.message.content or "") >= 2


def test_special_token_tags_through_the_scheduler(server: Any) -> None:
    """A tag opened and closed by the model's own special tokens (SmolLM2's <filename> = 6 and
    <file_sep> = 5, as Qwen's <tool_call> would be): a bias makes the model open tags; each holds
    a valid value and is closed by the token; the special tokens appear nowhere else."""
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<filename>", "schema": ADD, "end": "<file_sep>"}],
        "triggers": ["<filename>"],
    }
    params = {
        "structural_tag": tag,
        "max_new_tokens": 64,
        "temperature": 0,
        "logit_bias": {"6": 100},
        "skip_special_tokens": False,
    }
    body = {"text": "Sum: ", "sampling_params": params}
    resp = httpx.post(f"{server.url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ids, text = out["output_ids"], out["text"]
    opens = [i for i, t in enumerate(ids) if t == 6]
    assert len(opens) >= 2 and not set(ids) & ({0, 1, 3, 4} | set(range(7, 17)))
    assert text.count("<filename>") == len(opens)
    for part in text.split("<filename>")[1:-1]:  # complete tags (the last may be cut)
        body_text, sep, rest = part.partition("<file_sep>")
        assert sep and "<" not in rest, text
        jsonschema.validate(json.loads(body_text), ADD)
