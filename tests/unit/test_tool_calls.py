"""Tool calls: tool_choice plans, the call format, and what strict functions under auto get."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.tool_calls import (
    finish_reason,
    markers_are_special,
    plan_tools,
    split_output,
    tool_call_format,
)
from weft.runtime.server.http.tool_formats import FORMATS
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS, ToolFormat

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


# the tool-call parts of the models' own chat templates
QWEN3_CODER_TEMPLATE = """{%- for tool_call in message.tool_calls %}
    {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
    {%- for args_name, args_value in tool_call.arguments|items %}
        {{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}
    {%- endfor %}
    {{- '</function>\\n</tool_call>' }}
{%- endfor %}"""
LLAMA_PYTHONIC_TEMPLATE = (
    '{{- "If you decide to invoke any of the function(s), you MUST put it in the format of '
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    '\\n" }}\n{{- "You SHOULD NOT include any other text in the response.\\n" }}'
)
DEEPSEEK_V3_TEMPLATE = (
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}\n"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}\n"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"
)
DEEPSEEK_V31_TEMPLATE = (
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}\n"
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}\n"
    "{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"
)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),  # holds <tool_call> too: not hermes
        (LLAMA_PYTHONIC_TEMPLATE, "pythonic"),
        (DEEPSEEK_V3_TEMPLATE, "deepseekv3"),
        (DEEPSEEK_V31_TEMPLATE, "deepseekv31"),
        ({"default": "x", "tool_use": DEEPSEEK_V31_TEMPLATE}, "deepseekv31"),
    ],
)
def test_tool_call_format_knows_the_newer_templates(template: Any, fmt: str) -> None:
    assert tool_call_format(template) == fmt


def test_the_formats_registered_are_the_ones_named() -> None:
    assert set(FORMATS) == set(get_args(ToolFormat))
    assert {f for f in TOOL_CALL_PARSERS.values() if f is not None} == set(FORMATS)
    assert all(FORMATS[name].name == name for name in FORMATS)


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
    ("fmt", "call"),
    [
        ("deepseekv3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{ARGS}\n```"
                       "<｜tool▁call▁end｜>"),
        ("deepseekv31", "<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>"),
    ],
)  # fmt: skip
def test_strict_auto_deepseek_calls_are_constrained(fmt: str, call: str) -> None:
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    plan = plan_tools(strict, "auto", None, fmt)
    tag = plan.structural_tag or ""
    assert json.loads(tag)["format"]["triggers"] == ["<｜tool▁call▁begin｜>"]
    good = call.replace("{ARGS}", '{"city": "Oslo"}')
    assert walk_text(tag, "No call needed.") == "complete"
    assert (
        walk_text(tag, f"Sure. <｜tool▁calls▁begin｜>{good}{good}<｜tool▁calls▁end｜>")
        == "complete"
    )
    assert walk_text(tag, good[: good.index("Oslo")]) == "prefix"
    assert walk_text(tag, call.replace("{ARGS}", '{"city": 7}')) == "blocked"
    assert walk_text(tag, good.replace("weather", "nope")) == "blocked"
    parser = plan.parser()
    assert parser is not None
    assert split_output(parser, f"Sure. {good}")[1][0].arguments == '{"city": "Oslo"}'


@pytest.mark.parametrize("fmt", ["qwen3_coder", "pythonic"])
def test_strict_auto_is_refused_where_arguments_are_not_json(fmt: Any) -> None:
    """No JSON schema constrains XML or Python arguments: a 400 that says so, never a strict
    request served unconstrained; required and named stay JSON constraints."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    with pytest.raises(BadRequest, match=f"not enforceable with the {fmt} tool-call parser") as e:
        plan_tools(strict, "auto", None, fmt)
    assert 'tool_choice "required"' in str(e.value) and e.value.param == "tools"
    assert plan_tools(TOOLS, "auto", None, fmt).constraint() == {}  # not strict: parsed only
    required = plan_tools(strict, "required", None, fmt)
    assert required.strict and required.json_schema is not None
    parser = required.parser()
    assert parser is not None
    text = '[{"name": "time", "parameters": {}}]'
    assert [c.name for c in split_output(parser, text)[1]] == ["time"]


def test_the_plan_reads_calls_in_its_format() -> None:
    """The format the plan was made for reaches the parser, with the schemas its values need."""
    days = {"type": "object", "properties": {"days": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": days}}]
    call = "<tool_call>\n<function=weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    parser = plan_tools(tools, "auto", None, "qwen3_coder").parser()
    assert parser is not None
    content, calls = split_output(parser, f"Sure.\n{call}</tool_call>")
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("weather", '{"days": 3}')
    ]
    hermes = plan_tools(tools, "auto", None).parser()
    assert hermes is not None and split_output(hermes, call)[1] == []


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
    parser = plan_tools(TOOLS, "auto", None, "mistral").parser()
    assert parser is not None
    text = mistral_like.decode(ids, skip_special_tokens=False)
    assert [c.name for c in split_output(parser, text)[1]] == ["time"]
    hermes = plan_tools(TOOLS, "auto", None).parser()  # only the active format's markers
    assert hermes is not None and split_output(hermes, text) == (text, [])


@pytest.mark.parametrize(
    "marker", ["<|python_start|>", "<|python_tag|>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"]
)
def test_the_newer_formats_markers_keep_special_tokens_too(marker: str) -> None:
    import copy

    from test_constrain_support import tokenizer

    special = copy.deepcopy(tokenizer())
    special.add_special_tokens({"additional_special_tokens": [marker]})
    assert markers_are_special(special)
