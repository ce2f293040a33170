"""Tool calls: tool_choice plans, the call format, and what strict functions under auto get."""

from __future__ import annotations

import json
from typing import Any

import pytest

from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.tool_calls import (
    finish_reason,
    markers_are_special,
    plan_tools,
    split_output,
    tool_call_format,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "time"}},
]


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
