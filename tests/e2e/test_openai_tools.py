"""Tool calls through the openai client on a real `weft serve`: required, named, auto, none; and
a format other than the template's (--tool-call-parser qwen3_coder) with a forced output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "smollm2"
CITY: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time in a city", "parameters": CITY},
    },
]
NAMES = {t["function"]["name"] for t in TOOLS}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_time"}}
# the prompt is the same for every request (the radix cache keeps it): only decoding costs
COMMON: Any = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0}


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def create(client: openai.OpenAI) -> Callable[..., Any]:
    """create(key, **kw): a non-stream response, made once per key for the module (the stream
    tests compare with the same responses the other tests checked)."""
    cache: dict[str, Any] = {}

    def get(key: str, **kw: Any) -> Any:
        if key not in cache:
            cache[key] = client.chat.completions.create(**COMMON, **kw)
        return cache[key]

    return get


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_calls(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a finished tool-call choice, checked against OpenAI's shape and the tools."""
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    out = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in NAMES
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, CITY)
        out.append((call.function.name, args))
    assert len({c.id for c in choice.message.tool_calls}) == len(out)
    return out


def stream(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) assembled from a chat stream's deltas."""
    content, reason = "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**{**COMMON, **kw}, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not call["id"] and tc.id.startswith("call_") and tc.type == "function"
                call["id"] = tc.id
            assert tc.function is not None
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        if choice.finish_reason is not None:
            assert reason is None
            reason = choice.finish_reason
    assert sorted(calls) == list(range(len(calls)))
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


def test_required(create: Callable[..., Any]) -> None:
    out = create("required", tool_choice="required", max_tokens=64)
    assert check_calls(out.choices[0])


def test_required_one_call_when_not_parallel(create: Callable[..., Any]) -> None:
    out = create("single", tool_choice="required", parallel_tool_calls=False, max_tokens=64)
    assert len(check_calls(out.choices[0])) == 1


def test_named(create: Callable[..., Any]) -> None:
    out = create("named", tool_choice=NAMED, max_tokens=32)
    [(name, _)] = check_calls(out.choices[0])
    assert name == "get_time"


@pytest.mark.parametrize(
    ("key", "kw"),
    [
        ("required", {"tool_choice": "required", "max_tokens": 64}),
        ("named", {"tool_choice": NAMED, "max_tokens": 32}),
    ],
)
def test_stream_matches_non_stream(
    client: openai.OpenAI, create: Callable[..., Any], key: str, kw: dict[str, Any]
) -> None:
    content, calls, reason = stream(client, **kw)
    whole = create(key, **kw).choices[0]
    assert (content, calls, reason) == ("", calls_of(whole.message), whole.finish_reason)


def test_auto_is_well_formed(client: openai.OpenAI, create: Callable[..., Any]) -> None:
    """The small model may answer or call: either way the message has the right shape, and the
    stream (which holds back text that may be a call) assembles to the same message."""
    kw = {"tool_choice": "auto", "max_tokens": 8}
    choice = create("auto", **kw).choices[0]
    if choice.message.tool_calls:
        check_calls(choice)
    else:
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length")
    content, calls, reason = stream(client, **kw)
    assert (content or None, calls, reason) == (
        choice.message.content,
        calls_of(choice.message),
        choice.finish_reason,
    )


def test_auto_with_strict_functions_is_well_formed(client: openai.OpenAI) -> None:
    """Strict functions under auto: a structural tag constrains every call the model opens
    (grammar walks in tests/unit/test_tool_calls.py); the small model here may answer or call,
    and either way the message has the right shape, streamed or not."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw: Any = {**COMMON, "tools": strict, "tool_choice": "auto", "max_tokens": 24}
    choice = client.chat.completions.create(**kw).choices[0]
    if choice.message.tool_calls:
        check_calls(choice)
    else:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":  # a call the model opened was finished (a valid one)
            assert "<tool_call>" not in (choice.message.content or "")
    content, calls, reason = stream(client, tools=strict, tool_choice="auto", max_tokens=24)
    assert (content or None, calls, reason) == (
        choice.message.content,
        calls_of(choice.message),
        choice.finish_reason,
    )


def test_none_is_plain_content(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(**COMMON, tool_choice="none", max_tokens=4)
    choice = out.choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', not in"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined",
        ),
        (
            {
                "tools": [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS],
                "response_format": {"type": "json_object"},
            },
            r"tool calls are constrained \(strict functions\)",
        ),
    ],
)
def test_bad_tool_requests(client: openai.OpenAI, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError, match=needle) as info:
        client.chat.completions.create(**{**COMMON, "max_tokens": 4, **kw})
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


##### --tool-call-parser qwen3_coder (a tiny random Llama whose output is forced) #####

CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParís\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.fixture(scope="module")
def coder_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    from support import ServerProcess, save_tiny_llama

    root = tmp_path_factory.mktemp("qwen3-coder")
    model = save_tiny_llama(root / "model", default_model_dir)
    args = ["--model", str(model), "--served-model-name", "tiny", "--tool-call-parser",
            "qwen3_coder", "--cpu-threads", "1"]  # fmt: skip
    proc = ServerProcess(args, root / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_qwen3_coder_calls_whole_and_streamed(coder_server: Any) -> None:
    client = openai.OpenAI(base_url=f"{coder_server.url}/v1", api_key="unused", max_retries=0)
    forced = {"type": "const_string", "value": f"Let me check. {CODER_CALL}"}
    kw: Any = {"model": "tiny", "tools": TOOLS, "max_tokens": 64,
               "response_format": {"type": "structural_tag", "format": forced}}  # fmt: skip
    choice = client.chat.completions.create(**{**COMMON, **kw}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "París"},
    )
    assert stream(client, **kw) == ("Let me check.", calls_of(choice.message), "tool_calls")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    with pytest.raises(openai.BadRequestError, match="not enforceable with the qwen3_coder") as e:
        client.chat.completions.create(**{**COMMON, "model": "tiny", "tools": strict})
    assert e.value.body["param"] == "tools"  # type: ignore[index]


def test_call_arguments_are_validated_against_their_function(coder_server: Any) -> None:
    """Each parsed call's arguments are checked against its function's parameters (whole and
    streamed): an unconstrained call that breaks them says so (schema_valid false, the path)."""
    client = openai.OpenAI(base_url=f"{coder_server.url}/v1", api_key="unused", max_retries=0)
    long_city = CODER_CALL.replace("París", "Llanfairpwllgwyngyll")  # past maxLength 12
    text = f"{CODER_CALL}\n{long_city}"
    forced = {"type": "const_string", "value": text}
    kw: Any = {"model": "tiny", "tools": TOOLS, "max_tokens": 128,
               "response_format": {"type": "structural_tag", "format": forced}}  # fmt: skip
    good, bad = client.chat.completions.create(**{**COMMON, **kw}).choices[0].message.tool_calls
    assert good.model_extra == {"schema_valid": True}
    assert bad.model_extra["schema_valid"] is False
    assert bad.model_extra["schema_error"]["path"] == "/city"
    extras = []
    for chunk in client.chat.completions.create(**{**COMMON, **kw}, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            extras.append(tc.model_extra)
    assert [e["schema_valid"] for e in extras] == [True, False]
    assert extras[1]["schema_error"] == bad.model_extra["schema_error"]
