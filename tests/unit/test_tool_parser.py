"""Tool calls parsed out of outputs: constrained JSON shapes, the Hermes / Qwen, Mistral, Llama,
Qwen3-Coder XML, pythonic and DeepSeek V3 / V3.1 formats, whole outputs and streams alike
(runtime/server/http/tool_parser.py, tool_formats.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weft.runtime.server.http.tool_calls import split_output, stream_deltas
from weft.runtime.server.http.tool_formats import ANY_JSON, FORMATS
from weft.runtime.server.http.tool_parser import Mode, ToolCall, ToolCallParser

NAMES = frozenset({"weather", "time"})
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "temp": {"type": "number"},
        "hot": {"type": "boolean"},
        "none": {"type": "null"},
        "where": {"type": "object"},
        "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"type": ["string", "null"]},
        "any": {},
    },
}
PARAMS: dict[str, Any] = {"weather": WEATHER, "time": None}


def make_parser(
    mode: Mode = "auto", named: str | None = None, parallel: bool = True, fmt: str | None = None
) -> ToolCallParser:
    """A parser of `fmt` (a format of FORMATS; None: the parser's default, Hermes / Mistral /
    Llama JSON) for the functions of PARAMS."""
    return ToolCallParser(mode, NAMES, named, parallel, fmt=FORMATS[fmt] if fmt else ANY_JSON,
                          params=PARAMS)  # fmt: skip


def parse(
    text: str,
    mode: Mode = "auto",
    parallel: bool = True,
    named: str | None = None,
    fmt: str | None = None,
) -> tuple[str | None, list[tuple[str, Any]]]:
    """(content, [(name, arguments dict)]) of a whole output."""
    content, calls = split_output(make_parser(mode, named, parallel, fmt), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def parse_stream(
    text: str,
    cuts: list[int],
    mode: Mode = "auto",
    parallel: bool = True,
    named: str | None = None,
    fmt: str | None = None,
) -> tuple[str | None, list[tuple[str, Any]]]:
    """The same output fed in pieces cut at `cuts`: (content, calls) assembled from the pieces."""
    parser = make_parser(mode, named, parallel, fmt)
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


##### auto: Qwen3-Coder XML #####


def coder(name: str, **params: str) -> str:
    """A Qwen3-Coder call as the model writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_single_and_several_after_content() -> None:
    one = coder("weather", city="Paris")
    assert parse(one, fmt="qwen3_coder") == (None, [("weather", {"city": "Paris"})])
    text = f"I'll check both.\n\n{one}\n{coder('time')}\nDone."
    assert parse(text, fmt="qwen3_coder") == (
        "I'll check both.\nDone.",
        [("weather", {"city": "Paris"}), ("time", {})],
    )
    two_in_one = one.replace("</function>\n", "</function>\n<function=time>\n</function>\n")
    assert parse(two_in_one, fmt="qwen3_coder")[1] == [("weather", {"city": "Paris"}), ("time", {})]


def test_qwen3_coder_values_follow_the_parameter_schema() -> None:
    text = coder(
        "weather",
        city="42",  # a string stays a string
        days="3",
        temp="-1.5e1",
        hot="True",
        none="null",
        where='{"lat": 1.5, "tags": ["a"]}',
        hours="[9, 17]",
        note="null",  # string or null: the text
        any="{}",  # no type: the text
        extra="7",  # not in the schema: the text
    )
    [(name, args)] = parse(text, fmt="qwen3_coder")[1]
    assert name == "weather" and args == {
        "city": "42",
        "days": 3,
        "temp": -15.0,
        "hot": True,
        "none": None,
        "where": {"lat": 1.5, "tags": ["a"]},
        "hours": [9, 17],
        "note": "null",
        "any": "{}",
        "extra": "7",
    }
    not_json = coder("weather", days="three", hot="yes", where="{a: 1}", temp="NaN")
    assert parse(not_json, fmt="qwen3_coder")[1] == [
        ("weather", {"days": "three", "hot": "yes", "where": "{a: 1}", "temp": "NaN"})
    ]


def test_qwen3_coder_text_values_keep_their_lines_and_unicode() -> None:
    code = "def f():\n    return '<b>'\n"
    text = coder("weather", city="Zürich 東京 🌧", note=code)
    assert parse(text, fmt="qwen3_coder")[1] == [
        ("weather", {"city": "Zürich 東京 🌧", "note": code})
    ]  # one newline each side of a value is the format's, the rest is the value's


def test_qwen3_coder_missing_close_tag_at_the_end() -> None:
    text = coder("time").removesuffix("\n</tool_call>")
    assert parse(text, fmt="qwen3_coder") == (None, [("time", {})])


@pytest.mark.parametrize(
    "text",
    [
        coder("weather", city="Paris")[:-30],  # cut off
        coder("launch", city="Paris"),  # unknown function
        coder("weather", city="Paris").replace("</parameter>", ""),  # a parameter not closed
        coder("weather", city="Paris").replace("<parameter=city>\n", "city: "),  # text inside
        coder("time").replace("</tool_call>", "</tool"),
        coder("time").removesuffix("</tool_call>") + "and more",  # no close tag, text goes on
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',  # Hermes JSON
        "<tool_call>\nnot a function\n</tool_call>",
        "<tool_call>",
        "a <tool_c",
        '[TOOL_CALLS] [{"name": "time", "arguments": {}}]',  # another format's marker: text
    ],
)
def test_qwen3_coder_not_a_call_is_content(text: str) -> None:
    assert parse(text, fmt="qwen3_coder") == (text, [])


def test_qwen3_coder_bad_block_then_good_block() -> None:
    bad, good = coder("launch"), coder("time")
    assert parse(f"{bad}\n{good}", fmt="qwen3_coder") == (bad, [("time", {})])


##### auto: pythonic (Llama 3.2 / 4) #####


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('[weather(city="SF")]', [("weather", {"city": "SF"})]),
        ("  [weather(city='SF', days=2), time()]\n",
         [("weather", {"city": "SF", "days": 2}), ("time", {})]),
        ('<|python_start|>[weather(city="東京")]<|python_end|>', [("weather", {"city": "東京"})]),
        ("<|python_start|>[time()]", [("time", {})]),
        (
            "[weather(city=\"a'b\\\"c\", temp=-1.5, hot=True, none=None, where={'k': [1, (2, 3)]},"
            " note='''x\n]y''')]",
            [("weather", {"city": "a'b\"c", "temp": -1.5, "hot": True, "none": None,
                          "where": {"k": [1, [2, 3]]}, "note": "x\n]y"})],
        ),
    ],
)  # fmt: skip
def test_pythonic_whole_message(text: str, calls: list[tuple[str, Any]]) -> None:
    assert parse(text, fmt="pythonic") == (None, calls)


@pytest.mark.parametrize(
    "text",
    [
        '[weather(city="SF"',  # cut off
        '[weather(city="SF")',
        "[weather(city=)]",  # not Python
        '[launch(city="SF")]',  # unknown function
        '[weather("SF")]',  # a positional argument
        "[weather(city=sf)]",  # not a literal
        "[weather(**{'city': 'SF'})]",
        "[weather(city={1, 2})]",  # a set: no JSON form
        "[weather(temp=1e999)]",  # infinity: no JSON form
        "[tools.weather(city='SF')]",
        '[weather(city="SF")] is what I would call',  # not the whole message
        'I would call [weather(city="SF")]',
        "[]",
        "[1] Smith et al.",
        "[time(), 3]",
        '<tool_call>{"name": "time", "arguments": {}}</tool_call>',  # another format: text
    ],
)
def test_pythonic_not_a_call_is_content(text: str) -> None:
    assert parse(text, fmt="pythonic") == (text, [])


def test_pythonic_stream_releases_text_once_it_cannot_be_calls() -> None:
    parser = make_parser(fmt="pythonic")
    assert parser.feed(" [wea") == []  # may open a list of calls: held
    assert parser.feed("ther") == []
    assert parser.feed(" is fine") == [" [weather is fine"]
    assert make_parser(fmt="pythonic").feed("[It's 'sunny' [1]") == ["[It's 'sunny' [1]"]
    listed = make_parser(fmt="pythonic")
    assert listed.feed("[weather(city='SF'), ") == []
    assert listed.feed("42] it is") == ["[weather(city='SF'), 42] it is"]
    calls = make_parser(fmt="pythonic")
    assert calls.feed("[time()]") == []  # the message may go on
    [call] = calls.finish()
    assert isinstance(call, ToolCall) and call.name == "time"


##### auto: DeepSeek V3 / V3.1 #####

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def v3(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def v31(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


@pytest.mark.parametrize(("fmt", "call"), [("deepseekv3", v3), ("deepseekv31", v31)])
def test_deepseek_calls(fmt: str, call: Any) -> None:
    one = CALLS_BEGIN + call("weather", '{"city": "Paris"}') + CALLS_END
    assert parse(one, fmt=fmt) == (None, [("weather", {"city": "Paris"})])
    several = (
        "Let me look.\n\n" + CALLS_BEGIN + call("weather", '{"city": "Zürich", "days": 2}') + "\n"
        + call("time", "{}") + CALLS_END
    )  # fmt: skip
    assert parse(several, fmt=fmt) == (
        "Let me look.",
        [("weather", {"city": "Zürich", "days": 2}), ("time", {})],
    )
    values = '{"temp": -1.5, "hot": false, "none": null, "where": {"k": [1]}, "city": "東京"}'
    assert parse(CALLS_BEGIN + call("weather", values), fmt=fmt)[1] == [
        ("weather", json.loads(values))
    ]  # at the output's end the calls' end marker may be missing
    bare = "Sure. " + call("time", "{}")  # a call marker alone (what a strict tag triggers on)
    assert parse(bare, fmt=fmt) == ("Sure.", [("time", {})])


@pytest.mark.parametrize(("fmt", "call"), [("deepseekv3", v3), ("deepseekv31", v31)])
@pytest.mark.parametrize(
    ("name", "args", "cut"),
    [
        ("weather", '{"city": "Paris"}', True),  # cut off
        ("weather", '{"city": }', False),  # not JSON
        ("launch", "{}", False),  # unknown function
        ("weather", "[1]", False),  # arguments not an object
    ],
)
def test_deepseek_not_a_call_is_content(
    fmt: str, call: Any, name: str, args: str, cut: bool
) -> None:
    text = CALLS_BEGIN + call(name, args) + CALLS_END
    text = text[: text.index("Par") + 3] if cut else text
    assert parse(text, fmt=fmt) == (text, [])


def test_deepseek_versions_read_only_their_own_calls() -> None:
    assert parse(CALLS_BEGIN + v3("time", "{}"), fmt="deepseekv31")[1] == []
    assert parse(CALLS_BEGIN + v31("time", "{}"), fmt="deepseekv3")[1] == []
    bad_then_good = v31("launch", "{}") + v31("time", "{}")
    assert parse(bad_then_good, fmt="deepseekv31") == (v31("launch", "{}"), [("time", {})])


##### Streaming #####


def test_stream_releases_plain_text_early_and_holds_possible_calls() -> None:
    parser = ToolCallParser("auto", NAMES, fmt=ANY_JSON)
    assert parser.feed("Hello") == ["Hello"]
    assert parser.feed(" world <tool") == [" world"]  # "<tool" may open a call
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "time", "arguments": {}}') == []  # the close tag may come
    [call] = parser.feed("</tool_call>")
    assert isinstance(call, ToolCall) and call.name == "time" and call.id.startswith("call_")
    assert parser.finish() == []

    held = ToolCallParser("auto", NAMES, fmt=ANY_JSON)
    assert held.feed('{"answer": ') == []  # may be a Llama-style call: held
    assert held.feed("4} ok") == ['{"answer": 4} ok']  # decided: content


def test_stream_deltas_index_the_calls() -> None:
    parser = ToolCallParser("auto", NAMES, fmt=ANY_JSON)
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
    parser = ToolCallParser("auto", NAMES, fmt=ANY_JSON)
    for ch in text:
        assert parser.feed(ch) == []
    [call] = parser.finish()
    assert isinstance(call, ToolCall) and call.name == "weather"
    assert json.loads(call.arguments) == {"city": "x" * 40_000}


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("qwen3_coder", coder("weather", city="x" * 40_000)),
        ("pythonic", f"[weather(city='{'x' * 40_000}')]"),
        ("deepseekv31", CALLS_BEGIN + v31("weather", json.dumps({"city": "x" * 40_000}))),
    ],
)
def test_a_long_call_in_a_format_streamed_by_the_character_parses_whole(
    fmt: str, text: str
) -> None:
    """The formats' searches resume where they stopped, as the JSON scan does: O(n) a stream."""
    parser = make_parser(fmt=fmt)
    pieces = [piece for ch in text for piece in parser.feed(ch)] + parser.finish()
    assert [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)] == [
        ("weather", {"city": "x" * 40_000})
    ]
    assert len(pieces) == 1


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


FORMAT_SAMPLES = [
    (f"Checking.\n{coder('weather', city='Zürich', days='2')}\n{coder('time')}", "qwen3_coder"),
    (coder("weather", note="a </parameter b\n<tool_call>") + " bye", "qwen3_coder"),
    (coder("launch") + coder("time").removesuffix("\n</tool_call>"), "qwen3_coder"),
    ("<tool_call>\n<function=weather>\n<parameter=city>\nPar", "qwen3_coder"),
    ("<|python_start|>[weather(city='東京', days=2), time()]<|python_end|>\n", "pythonic"),
    ("[weather(note='''a ] ) \" b''', hours=[9, 17])]", "pythonic"),
    ("[weather(city='SF')] and then", "pythonic"),
    ("[1, 2] (a list)", "pythonic"),
    ('Sure. ' + CALLS_BEGIN + v3("weather", '{"city": "}"}') + "\n" + v3("time", "{}") + CALLS_END,
     "deepseekv3"),
    (CALLS_BEGIN + v31("weather", '{"city": "Oslo"}') + v31("launch", "{}") + CALLS_END + " ok",
     "deepseekv31"),
    (CALLS_BEGIN + '<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Os', "deepseekv31"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "fmt"), FORMAT_SAMPLES)
def test_a_format_streamed_by_the_character_matches_whole(text: str, fmt: str) -> None:
    assert parse_stream(text, list(range(len(text))), fmt=fmt) == parse(text, fmt=fmt)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FORMAT_SAMPLES), st.lists(st.integers(0, 160), max_size=12))
def test_a_format_stream_matches_whole(sample: tuple[str, str], cuts: list[int]) -> None:
    text, fmt = sample
    cuts = [c for c in cuts if c <= len(text)]
    assert parse_stream(text, cuts, fmt=fmt) == parse(text, fmt=fmt)


FORMAT_FRAGMENTS = {
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=time>", "<function=weather>",
                    "</function>", "<parameter=days>", "</parameter>", "\n", "3", "x", "<", ">"],
    "pythonic": ["[", "]", "(", ")", "time()", "weather(", "days=3", "city='a'", ",", "'", '"',
                 "<|python_start|>", "<|python_end|>", " ", "x"],
    "deepseekv3": [CALLS_BEGIN, CALLS_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                   "function", "<｜tool▁sep｜>", "time", "\n", "```json", "```", "{}", "{", "x"],
    "deepseekv31": [CALLS_BEGIN, CALLS_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>", "time", "weather", '{"city": "a"}', "{}", "}", " ", "x"],
}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_format_stream_matches_whole_on_any_text(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(sorted(FORMAT_FRAGMENTS)))
    text = "".join(data.draw(st.lists(st.sampled_from(FORMAT_FRAGMENTS[fmt]), max_size=16)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    whole = parse(text, fmt=fmt)
    assert parse_stream(text, cuts, fmt=fmt) == whole
    if not whole[1]:
        assert whole[0] == text  # no calls: the content is the text exactly
