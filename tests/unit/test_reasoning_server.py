"""--reasoning-parser through a real `weft serve` (tiny random Llama whose tokenizer has <think>
and </think> as added tokens, CPU) and the openai client: reasoning_content split from content,
whole and streamed; a JSON schema applies only after </think>
and the answer alone is validated; separate_reasoning=false; SGLang's /separate_reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

# the output, forced: the markers are the added tokens, as a model writes them
FORCED = {
    "type": "structural_tag",
    "format": {"type": "const_string", "value": '<think>ab</think>{"a":1}'},
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # qwen3: no wrapped grammar
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 2]}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from support import ServerProcess, save_tiny_llama
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("reasoning")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_tokens(["<think>", "</think>"])  # special=False, as Qwen3's and DeepSeek-R1's
    tok.save_pretrained(root / "tok")
    model = save_tiny_llama(root / "model", root / "tok", vocab_size=len(tok))
    args = ["--model", str(model), "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
            "--cpu-threads", "1"]  # fmt: skip
    proc = ServerProcess(args, root / "serve.log")
    try:
        proc.wait_ready()
        proc.end_id = tok.convert_tokens_to_ids("</think>")
        yield proc
    finally:
        proc.stop()


def client(server: Any) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(server: Any, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": "Hi"}]
    return client(server).chat.completions.create(
        model="tiny", messages=messages, temperature=0, **kwargs
    )


def test_reasoning_content_is_split_from_the_content(server: Any) -> None:
    out = chat(server, max_tokens=40, response_format=FORCED, extra_body=NO_THINKING)
    message = out.choices[0].message
    assert message.reasoning_content == "ab"  # type: ignore[attr-defined]
    assert message.content == '{"a":1}'
    assert out.choices[0].finish_reason == "stop"


def test_streamed_reasoning_holds_markers_cut_across_chunks(server: Any) -> None:
    stream = chat(
        server, max_tokens=40, stream=True, response_format=FORCED, extra_body=NO_THINKING
    )
    reasoning, content, finish = [], [], None
    for ev in stream:
        delta = ev.choices[0].delta
        got = getattr(delta, "reasoning_content", None)
        if got:
            reasoning.append(got)
        if delta.content:
            content.append(delta.content)
        finish = ev.choices[0].finish_reason or finish
    assert "".join(reasoning) == "ab" and "".join(content) == '{"a":1}'
    assert not any("think>" in piece for piece in reasoning + content)
    assert finish == "stop"


def test_separate_reasoning_false_keeps_the_text(server: Any) -> None:
    body = {"separate_reasoning": False, **NO_THINKING}
    out = chat(server, max_tokens=40, response_format=FORCED, extra_body=body)
    message = out.choices[0].message
    assert message.content == '<think>ab</think>{"a":1}'
    assert getattr(message, "reasoning_content", None) is None


def test_schema_applies_after_the_reasoning(server: Any) -> None:
    """Thinking on (qwen3's default): the model ends its reasoning with the </think> token (here
    pushed by logit_bias), then writes JSON of the schema; its answer alone is validated."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    bias = {str(server.end_id): 100}
    out = chat(server, max_tokens=60, response_format=fmt, logit_bias=bias)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert json.loads(choice.message.content) in ({"a": 1}, {"a": 2})
    assert not getattr(choice.message, "reasoning_content", None)
    assert choice.model_extra["schema_valid"] is True


def test_reasoning_before_the_end_marker_is_free(server: Any) -> None:
    """Without the end marker the output stays free text (no '{' forced): all reasoning."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = chat(server, max_tokens=6, response_format=fmt)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    reasoning = choice.message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and not reasoning.lstrip().startswith("{")
    assert choice.message.content == ""
    assert choice.model_extra["schema_valid"] is False  # no answer: reported, never hidden


def test_native_separate_reasoning(server: Any) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/separate_reasoning", json=body, timeout=30)

    got = post({"text": "<think>x</think>y"}).json()
    assert got == {"text": "y", "reasoning_text": "x"}
    got = post({"text": "x</think>y", "reasoning_parser": "deepseek-r1"}).json()
    assert got == {"text": "y", "reasoning_text": "x"}
    assert post({"text": "x</think>y"}).json() == {"text": "x</think>y", "reasoning_text": ""}
    bad = post({"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and "reasoning_parser must be one of" in bad.text


def test_thinking_budget_forces_the_end_marker(server: Any) -> None:
    """thinking_budget=N: after the start marker and N reasoning tokens, </think> is forced;
    the model (pushed to repeat <think> by logit_bias) never writes it on its own."""
    start_id = server.end_id - 1  # added right before </think>
    bias = {str(start_id): 100}
    out = chat(server, max_tokens=12, logit_bias=bias, extra_body={"thinking_budget": 4})
    message = out.choices[0].message
    assert message.reasoning_content == "<think>" * 4  # type: ignore[attr-defined]
    assert message.content == "<think>" * 6
    free = chat(server, max_tokens=12, logit_bias=bias)  # no budget: all reasoning
    assert free.choices[0].message.content == ""


def test_thinking_budget_then_the_schema(server: Any) -> None:
    """A budget with a schema: free reasoning for 3 tokens, </think> forced, then the answer
    under the schema (the constraint's structural tag accepts the forced marker)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = chat(server, max_tokens=60, response_format=fmt, extra_body={"thinking_budget": 3})
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert json.loads(choice.message.content) in ({"a": 1}, {"a": 2})
    assert choice.model_extra["schema_valid"] is True
    assert out.usage.completion_tokens >= 1 + 3 + 1 + 5  # <think>, 3 tokens, </think>, {"a":1}


def test_thinking_budget_is_checked(server: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="thinking_budget"):
        chat(server, max_tokens=4, extra_body={"thinking_budget": -1})
    body = {"text": "Hi", "sampling_params": {"thinking_budget": "x", "max_new_tokens": 2}}
    resp = httpx.post(f"{server.url}/generate", json=body, timeout=30)
    assert resp.status_code == 400 and "thinking_budget" in resp.text
