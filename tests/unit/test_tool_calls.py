"""Tool calls: tool_choice plans, and parsing of constrained and model-native call formats."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.http.app import BadRequest
from weft.runtime.http.tool_calls import (
    finish_reason,
    markers_are_special,
    plan_tools,
    split_output,
    stream_deltas,
    tool_call_format,
)
from weft.runtime.http.tool_parser import Mode, ToolCall, ToolCallParser

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "time"}},
]
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


##### tool_choice #####


def test_plan_modes() -> None:
    assert plan_tools(None, None, None).mode == "none"
    none = plan_tools(TOOLS, "none", None)
    assert none.mode == "none" and none.tools is None and none.parser() is None
    auto = plan_tools(TOOLS, None, None)
    assert auto.mode == "auto" and auto.tools == TOOLS and auto.json_schema is None
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    assert named.mode == "named" and json.loads(named.json_schema or "") == CITY


def test_plan_required_schema() -> None:
    schema = json.loads(plan_tools(TOOLS, "required", None).json_schema or "")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"] for i in items] == [{"enum": ["weather"]}, {"enum": ["time"]}]
    assert items[0]["properties"]["parameters"] == CITY
    assert items[1]["properties"]["parameters"] == {"type": "object"}  # no parameters given
    one = json.loads(plan_tools(TOOLS, "required", False).json_schema or "")
    assert one["maxItems"] == 1


def test_plan_strict_follows_the_constrained_functions() -> None:
    strict_weather = [
        {"type": "function", "function": {"name": "weather", "parameters": CITY, "strict": True}},
        TOOLS[1],
    ]
    assert not plan_tools(TOOLS, "required", None).strict
    assert plan_tools(strict_weather, "required", None).strict  # any constrained one says so
    weather = {"type": "function", "function": {"name": "weather"}}
    time_ = {"type": "function", "function": {"name": "time"}}
    assert plan_tools(strict_weather, weather, None).strict
    assert not plan_tools(strict_weather, time_, None).strict
    auto = plan_tools(strict_weather, "auto", None)  # calls in free text: a structural tag
    assert auto.strict and auto.structural_tag is not None and auto.json_schema is None
    assert auto.constraint() == {"structural_tag": auto.structural_tag, "strict_json_schema": True}
    assert plan_tools(TOOLS, "auto", None).constraint() == {}  # no strict function: parsed only


def test_tool_call_format_follows_the_chat_template() -> None:
    assert tool_call_format("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert tool_call_format({"default": "x", "tool_use": "[TOOL_CALLS] [...]"}) == "mistral"
    assert tool_call_format('{{- \'{"name": "\' + name + \'", "parameters": \' }}') == "llama"
    assert tool_call_format("<|python_tag|>") == "llama"
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"
    assert tool_call_format(None) == "hermes"


def walk_ids(spec: str, ids: list[int], tokenizer: Any = None) -> str:
    """'complete', 'prefix' or 'blocked': token ids one by one through the structural tag's
    matcher (SmolLM2's tokenizer, or `tokenizer`)."""
    from test_constrain_support import STOP, VOCAB, backend, walk

    from weft.constrain import GrammarSpec, create_grammar_backend

    if tokenizer is None:
        grammars, vocab = backend("llguidance"), VOCAB
    else:
        grammars = create_grammar_backend("llguidance", tokenizer, len(tokenizer), [STOP])
        vocab = len(tokenizer)
    w = walk(grammars.compile(GrammarSpec("structural_tag", spec)).matcher(), ids, vocab)
    if w.blocked_at is not None:
        return "blocked"
    return "complete" if w.stop_at_end else "prefix"


def walk_text(spec: str, text: str, tokenizer: Any = None) -> str:
    """walk_ids of `text` as the tokenizer encodes it."""
    from test_constrain_support import encode

    ids = encode(text) if tokenizer is None else tokenizer.encode(text, add_special_tokens=False)
    return walk_ids(spec, ids, tokenizer)


def test_strict_auto_calls_are_constrained_to_known_functions_and_their_schemas() -> None:
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    tag = plan_tools(strict, "auto", None).structural_tag or ""
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert walk_text(tag, "No call needed.") == "complete"
    assert walk_text(tag, f"Let me check. {call} Done.") == "complete"
    assert walk_text(tag, call + call) == "complete"  # parallel calls
    assert walk_text(tag, call[:-5]) == "prefix"
    assert walk_text(tag, call.replace('"Oslo"', "7")) == "blocked"  # against the schema
    assert walk_text(tag, call.replace("weather", "nope")) == "blocked"  # unknown function
    one = plan_tools(strict, "auto", False).structural_tag or ""
    assert walk_text(one, f"{call} more") == "blocked"  # one call, then the output ends
    parser = plan_tools(strict, "auto", None).parser()
    assert parser is not None
    content, calls = split_output(parser, f"Let me check. {call}")
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [
        ("weather", '{"city": "Oslo"}')
    ]
    mistral = plan_tools(strict, "auto", None, "mistral").structural_tag or ""
    m_call = '[TOOL_CALLS] [{"name": "time", "arguments": {}}]'
    assert walk_text(mistral, f"Sure. {m_call}") == "complete"
    llama = plan_tools(strict, "auto", None, "llama").structural_tag or ""
    l_call = '{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert walk_text(llama, l_call) == "complete"  # the whole message: one call
    assert walk_text(llama, "\n " + l_call) == "complete"
    assert walk_text(llama, l_call + " more") == "blocked"
    assert walk_text(llama, '{"name": "weather", "parameters": {"city": 7}}') == "blocked"
    assert walk_text(llama, '{"city": "Oslo"}') == "blocked"  # from `{`: a call or nothing
    assert walk_text(llama, "It is sunny {maybe}.") == "complete"  # not from `{`: free text
    assert walk_text(llama, "") == "complete"
    content, calls = split_output(plan_tools(strict, "auto", None, "llama").parser(), l_call)
    assert content is None and [c.name for c in calls] == ["weather"]


@pytest.mark.parametrize(
    ("tools", "choice", "needle"),
    [
        (None, "required", "only allowed when tools are given"),
        ([], "auto", "only allowed when tools are given"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', not in tools"),
    ],
)
def test_plan_errors(tools: Any, choice: Any, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle) as info:
        plan_tools(tools, choice, None)
    assert info.value.param == "tool_choice"


def test_finish_reason() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"
    assert finish_reason("abort", True) == "abort"
    assert finish_reason(None, False) is None


##### Constrained outputs (required, named) #####


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


def test_stream_is_linear() -> None:
    """A long JSON answer streamed one character at a time is scanned once, not per delta."""
    text = json.dumps({"name": "weather", "parameters": {"city": "x" * 40_000}})
    parser = ToolCallParser("auto", NAMES)
    began = time.perf_counter()
    for ch in text:
        assert parser.feed(ch) == []
    [call] = parser.finish()
    assert isinstance(call, ToolCall) and time.perf_counter() - began < 2.0


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


def test_qwen_style_tool_call_tokens_are_written_as_the_tokens() -> None:
    """Qwen's <tool_call> and </tool_call> are added tokens: the model opens and closes a call
    with them, never with their text spelled in ordinary tokens."""
    import copy

    from test_constrain_support import tokenizer

    qwen_like = copy.deepcopy(tokenizer())
    qwen_like.add_tokens(["<tool_call>", "</tool_call>"])  # special=False, as in Qwen's
    opener = qwen_like.convert_tokens_to_ids("<tool_call>")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    tag = plan_tools(strict, "auto", None).structural_tag or ""
    call = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    assert qwen_like.encode(call, add_special_tokens=False)[0] == opener
    assert walk_text(tag, f"Checking. {call} Done.", qwen_like) == "complete"
    assert walk_text(tag, "No call.", qwen_like) == "complete"
    # the same text in ordinary tokens (SmolLM2's own tokenizer has no such token) is blocked
    spelled = tokenizer().encode("<tool_call>", add_special_tokens=False)
    assert len(spelled) > 1 and opener not in spelled
    assert walk_ids(tag, spelled, qwen_like) == "blocked"


def test_special_markers_keep_special_tokens_in_the_text() -> None:
    """Mistral's [TOOL_CALLS] is a special token: the chat route then detokenizes with special
    tokens kept, or the parser would never see a call begin."""
    import copy

    from test_constrain_support import tokenizer

    assert not markers_are_special(tokenizer())
    mistral_like = copy.deepcopy(tokenizer())
    mistral_like.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    assert markers_are_special(mistral_like)
    marker = mistral_like.convert_tokens_to_ids("[TOOL_CALLS]")
    call = '[TOOL_CALLS] [{"name": "time", "arguments": {}}]'
    ids = mistral_like.encode(call, add_special_tokens=False)
    assert ids[0] == marker
    parser = plan_tools(TOOLS, "auto", None).parser()
    assert parser is not None
    text = mistral_like.decode(ids, skip_special_tokens=False)
    assert [c.name for c in split_output(parser, text)[1]] == ["time"]
