"""Every JSON-schema output is validated against its full schema: meta_info `schema_valid` (and
`schema_error`) on /generate and the Engine, the same fields on OpenAI choices; and
--grammar-strictness strict refuses what the grammar cannot enforce, naming keyword and pointer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import weft

MODEL = "smollm2"
# the grammar forces [1, 1] (uniqueItems is not enforced): always invalid, deterministically
DUPES = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
# forces [1]: always valid
ONE = {"type": "array", "items": {"const": 1}, "minItems": 1, "maxItems": 1, "uniqueItems": True}
CHAT: Any = [{"role": "user", "content": "A JSON array."}]


def generate(server: Any, schema: Any, stream: bool = False) -> httpx.Response:
    body = {
        "text": "Numbers: ",
        "sampling_params": {"json_schema": schema, "max_new_tokens": 48, "temperature": 0},
        "stream": stream,
    }
    return httpx.post(f"{server.url}/generate", json=body, timeout=120)


def test_native_reports_schema_validity(server: Any) -> None:
    meta = generate(server, DUPES).json()["meta_info"]
    assert meta["schema_valid"] is False and meta["unenforced_keywords"] == ["uniqueItems"]
    assert meta["schema_error"]["keyword_path"] == "/uniqueItems"
    assert "non-unique" in meta["schema_error"]["message"]
    good = generate(server, ONE).json()["meta_info"]
    assert good["schema_valid"] is True and "schema_error" not in good
    events = [
        json.loads(line[len("data: ") :])
        for line in generate(server, DUPES, stream=True).text.splitlines()
        if line.startswith("data: {")
    ]
    assert events[-1]["meta_info"]["schema_valid"] is False
    plain = httpx.post(
        f"{server.url}/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
        timeout=120,
    ).json()
    assert "schema_valid" not in plain["meta_info"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_choices_carry_schema_validity(server: Any, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": DUPES}}
    if not stream:
        chat = client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=fmt, max_tokens=16, temperature=0
        )
        extra = chat.choices[0].model_extra or {}
        # never valid: either [1, 1] or cut short (SmolLM2 may write whitespace to max_tokens)
        assert extra["schema_valid"] is False and extra["schema_error"]["message"]
        done = client.completions.create(
            model=MODEL, prompt="A:", extra_body={"response_format": fmt}, max_tokens=16
        )
        assert (done.choices[0].model_extra or {})["schema_valid"] is False
        return
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=fmt, max_tokens=16, stream=True
        )
    )
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert (last.model_extra or {})["schema_valid"] is False
    assert not any("schema_valid" in (c.choices[0].model_extra or {}) for c in chunks[:-1])


def test_strict_engine_refuses_with_keyword_and_pointer(tiny_model_dir: Path) -> None:
    # (DUPES itself is now exact: no array is valid there, so an optional property of it is
    # compiled as absent; unique integers are not enforceable)
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    nested = {"type": "object", "properties": {"ids": unique}}
    with weft.Engine(str(tiny_model_dir), grammar_strictness="strict") as eng:
        with pytest.raises(ValueError, match=r"uniqueItems \(at #/properties/ids/uniqueItems\)"):
            eng.generate("x", {"json_schema": json.dumps(nested), "max_new_tokens": 4})
        out = eng.generate(
            "x", {"json_schema": json.dumps({"const": [1, 2]}), "max_new_tokens": 32}
        )
        meta = out["meta_info"]  # a random model: it may write whitespace to max_new_tokens
        assert meta["schema_valid"] is (meta["finish_reason"]["type"] == "stop"), out
    with pytest.raises(ValueError, match="grammar_strictness"):
        weft.Engine(str(tiny_model_dir), grammar_strictness="exact")
