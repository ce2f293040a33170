"""Tool calls parsed out of outputs: constrained JSON shapes, Hermes / Qwen, Mistral and Llama
formats, whole outputs and streams alike (runtime/server/http/tool_parser.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.server.http.tool_calls import split_output, stream_deltas
from weft.runtime.server.http.tool_parser import Mode, ToolCall, ToolCallParser

NAMES = frozenset({"weather", "time"})


def parse(
    text: str, mode: Mode = "auto", parallel: bool = True, named: str | None = None
) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, [(name, arguments dict)]) of a whole output."""
    content, calls = split_output(ToolCallParser(mode, NAMES, named, parallel), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def parse_stream(
    text: str, cuts: list[int], mode: Mode = "auto", parallel: bool = True, named: str | None = None
) -> tuple[str | None, list[tuple[str, Any]]]:
    """The same output fed in pieces cut at `cuts`: (content, calls) assembled from the pieces."""
    parser = ToolCallParser(mode, NAMES, named, parallel)
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces: list[str | ToolCall] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        pieces += parser.feed(text[a:b])
    pieces += parser.finish()
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (None if calls and not content else content), calls


def test_required_array() -> None:
    text = (
        '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "time", "parameters": {}}]'
    )
    assert parse(text, "required") == (None, [("weather", {"city": "Paris"}), ("time", {})])


def test_required_parallel_false_keeps_one() -> None:
    text = '[{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "X"}}]'
    assert parse(text, "required", parallel=False) == (None, [("time", {})])


def test_named_arguments() -> None:
    assert parse(' {"city": "Oslo"} ', "named", named="weather") == (
        None,
        [("weather", {"city": "Oslo"})],
    )


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ('[{"name": "weather", "parameters": {"city": "Par', "required"),  # cut by length
        ('{"city": "Par', "named"),
        ("[]", "required"),
        ('[{"name": "other", "parameters": {}}]', "required"),
        ('{"name": "time", "parameters": {}}', "required"),  # not an array
        ('["city"]', "named"),  # not an object
        ('{"city": "x",}', "named"),  # balanced but not JSON
    ],
)
def test_constrained_not_a_call_is_content(text: str, mode: Mode) -> None:
    named = "weather" if mode == "named" else None
    assert parse(text, mode, named=named) == (text, [])


##### auto: Hermes / Qwen #####


def test_hermes_single() -> None:
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert parse(text) == (None, [("weather", {"city": "Rome"})])


def test_hermes_several_with_text_around() -> None:
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>\n'
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>\nDone.'
    )
    content, calls = parse(text)
    assert calls == [("weather", {"city": "A"}), ("time", {})]
    assert content == "Let me check.\nDone."


def test_hermes_missing_close_tag_at_the_end() -> None:
    assert parse('<tool_call>{"name": "time", "arguments": {}}') == (None, [("time", {})])


def test_hermes_string_arguments() -> None:
    text = '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"B\\"}"}</tool_call>'
    assert parse(text) == (None, [("weather", {"city": "B"})])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "weather", "arguments": {"city": }}</tool_call>',  # malformed
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # unknown function
        '<tool_call>{"name": "weather", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "weather", "arguments": {"city": "Par',  # cut off
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "time"} and more text',
        "<tool_call>",
        "a <tool_c",
    ],
)
def test_hermes_not_a_call_is_content(text: str) -> None:
    assert parse(text) == (text, [])


def test_hermes_bad_block_then_good_block() -> None:
    text = (
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call> '
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    )
    content, calls = parse(text)
    assert calls == [("time", {})]
    assert content == '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'


def test_auto_parallel_false_keeps_the_first() -> None:
    text = (
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {"city": "C"}}</tool_call>'
    )
    assert parse(text, parallel=False) == (None, [("time", {})])


##### auto: Llama 3.1 JSON, Mistral #####


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "weather", "parameters": {"city": "Lima"}}',
        '  <|python_tag|>{"name": "weather", "parameters": {"city": "Lima"}}\n',
        '{"name": "weather", "arguments": {"city": "Lima"}}',
    ],
)
def test_llama_json_whole_message(text: str) -> None:
    assert parse(text) == (None, [("weather", {"city": "Lima"})])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "weather", "parameters": {"city": "Lima"}} is what I would call.',
        '{"name": "launch", "parameters": {}}',
        '{"answer": 4}',
        '{"name": "weather", "parameters": {"city": "Li',
        '{"name": "weather", "parameters": {"city": }}',
        'The call: {"name": "weather", "parameters": {"city": "Lima"}}',  # not the whole message
    ],
)
def test_llama_json_not_a_call_is_content(text: str) -> None:
    assert parse(text) == (text, [])


def test_mistral() -> None:
    text = '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Kyiv"}}, {"name": "time", "arguments": {}}]'
    assert parse(text) == (None, [("weather", {"city": "Kyiv"}), ("time", {})])
    single = '[TOOL_CALLS]{"name": "time", "arguments": {}}'
    assert parse(single) == (None, [("time", {})])


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "time", "arguments": {}}, {"name": "launch", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "time", "arguments": {',
        "[TOOL_CALLS] no calls",
    ],
)
def test_mistral_not_a_call_is_content(text: str) -> None:
    assert parse(text) == (text, [])


def test_plain_text_is_content_exactly() -> None:
    for text in ["", "  ", "Hello world \n", "[1, 2]", "<b>bold</b>", "x < y and {a}"]:
        assert parse(text) == (text, [])


##### Streaming #####


def test_stream_releases_plain_text_early_and_holds_possible_calls() -> None:
    parser = ToolCallParser("auto", NAMES)
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" world <tool") == [" world"]  # "<tool" may open a call
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "time", "arguments": {}}') == []  # the close tag may come
    [call] = parser.feed("</tool_call>")
    assert isinstance(call, ToolCall) and call.name == "time" and call.id.startswith("call_")
    assert parser.finish() == []

    held = ToolCallParser("auto", NAMES)
    assert held.feed('{"answer": ') == []  # may be a Llama-style call: held
    assert held.feed("4} ok") == ['{"answer": 4} ok']  # decided: content


def test_stream_deltas_index_the_calls() -> None:
    parser = ToolCallParser("auto", NAMES)
    block = '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    first = stream_deltas(parser, "Sure. " + block + block, final=False)
    assert first[0] == {"content": "Sure."}
    assert [d["tool_calls"][0]["index"] for d in first[1:]] == [0, 1]
    [last] = stream_deltas(parser, block, final=True)
    call = last["tool_calls"][0]
    assert call["index"] == 2 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "time", "arguments": "{}"}


SAMPLES = [
    ('Hi <tool_call>{"name": "time", "arguments": {}}</tool_call> bye', "auto"),
    ('<tool_call>{"name": "weather", "arguments": {"city": "a}\\"b"}}</tool_call>', "auto"),
    ('{"name": "weather", "parameters": {"city": "Lima"}}', "auto"),
    ('[TOOL_CALLS][{"name": "time", "arguments": {}}] trailing', "auto"),
    ("<tool_call>{broken</tool_call> x <tool_ca", "auto"),
    (
        '[{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "["}}]',
        "required",
    ),
    ('{"city": "N"}', "named"),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SAMPLES), st.lists(st.integers(0, 120), max_size=12))
def test_stream_matches_whole(sample: tuple[str, Mode], cuts: list[int]) -> None:
    text, mode = sample
    named = "weather" if mode == "named" else None
    cuts = [c for c in cuts if c <= len(text)]
    assert parse_stream(text, cuts, mode, named=named) == parse(text, mode, named=named)


def test_a_long_call_streamed_by_the_character_parses_whole() -> None:
    """A long JSON answer streamed one character at a time yields nothing until it ends, then the
    one call. (Its time per character: `python benchmarks/host.py tool-parser`.)"""
    text = json.dumps({"name": "weather", "parameters": {"city": "x" * 40_000}})
    parser = ToolCallParser("auto", NAMES)
    for ch in text:
        assert parser.feed(ch) == []
    [call] = parser.finish()
    assert isinstance(call, ToolCall) and call.name == "weather"
    assert json.loads(call.arguments) == {"city": "x" * 40_000}


FRAGMENTS = [
    "Hi",
    " ",
    "\n",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ",",
    "<",
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    '"name": "time"',
    '"arguments": {}',
    '{"name": "time", "arguments": {}}',
    '{"name": "weather", "parameters": {"city": "Q"}}',
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join),
    st.lists(st.integers(0, 200), max_size=10),
    st.sampled_from(["auto", "required", "named"]),
)
def test_stream_matches_whole_on_any_text(text: str, cuts: list[int], mode: Mode) -> None:
    named = "weather" if mode == "named" else None
    whole = parse(text, mode, named=named)
    assert parse_stream(text, [c for c in cuts if c <= len(text)], mode, named=named) == whole
    if not whole[1]:
        assert whole[0] == text  # no calls: the content is the text exactly
