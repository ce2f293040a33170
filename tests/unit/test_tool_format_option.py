"""--tool-call-parser: the tool-call format named on the command line or read off the chat
template, worked out once per server, and the constraint strict functions get from it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from weft import cli
from weft.runtime.server.http.openai_chat import _tool_format
from weft.runtime.server.http.state import AppState, ServerConfig
from weft.runtime.server.http.tool_calls import plan_tools, resolve_tool_format
from weft.runtime.server.http.tool_parser import TOOL_CALL_PARSERS

HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '<tool_call>' }}"
STRICT = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize(
    "parser, expected",
    [("auto", "hermes"), ("hermes", "hermes"), ("qwen25", "hermes"), ("mistral", "mistral"),
     ("llama3", "llama"), ("qwen3_coder", "qwen3_coder"), ("pythonic", "pythonic"),
     ("deepseekv3", "deepseekv3"), ("deepseekv31", "deepseekv31")],
)  # fmt: skip
def test_a_named_parser_overrides_the_template(parser: str, expected: str) -> None:
    assert resolve_tool_format(parser, HERMES_TEMPLATE) == expected
    assert resolve_tool_format("auto", "[TOOL_CALLS] [{...}]") == "mistral"
    assert resolve_tool_format("auto", "<tool_call>\n<function=f>\n<parameter=a>") == "qwen3_coder"


def test_an_unknown_parser_is_refused_by_the_config_and_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        ServerConfig(tool_call_parser="kimi_k2")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--tool-call-parser", "kimi_k2"])
    assert "invalid choice: 'kimi_k2'" in capsys.readouterr().err
    assert set(TOOL_CALL_PARSERS) == {"auto", "hermes", "qwen25", "mistral", "llama3",
                                      "qwen3_coder", "pythonic", "deepseekv3", "deepseekv31"}  # fmt: skip
    for name in ("qwen3_coder", "pythonic", "deepseekv3", "deepseekv31"):
        assert ServerConfig(tool_call_parser=name).tool_call_parser == name


class _Tokenizer:
    chat_template = HERMES_TEMPLATE
    all_special_tokens = ["<|im_end|>", "[TOOL_CALLS]"]

    def __init__(self) -> None:
        self.reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "all_special_tokens":
            object.__setattr__(self, "reads", object.__getattribute__(self, "reads") + 1)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("parser, fmt", [("auto", "hermes"), ("mistral", "mistral")])
def test_the_server_works_the_format_out_once_and_strict_auto_follows_it(
    parser: str, fmt: str
) -> None:
    state = AppState(ServerConfig(tool_call_parser=parser))
    tokenizer = _Tokenizer()
    state.runtime = SimpleNamespace(tokenizer=tokenizer)  # type: ignore[assignment]
    assert _tool_format(state) == (fmt, True)  # [TOOL_CALLS] is a special token here
    assert _tool_format(state) == (fmt, True)
    assert tokenizer.reads == 1
    tag = json.loads(plan_tools(STRICT, "auto", None, state.tool_format[0]).structural_tag or "")
    marker = "[TOOL_CALLS]" if fmt == "mistral" else "<tool_call>"
    assert tag["format"]["triggers"] == [marker]


class _DeepSeekTokenizer:
    chat_template = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] }}"
    all_special_tokens = ["<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>"]


def test_a_deepseek_template_gets_its_format_and_keeps_its_special_markers() -> None:
    state = AppState(ServerConfig())
    state.runtime = SimpleNamespace(tokenizer=_DeepSeekTokenizer())  # type: ignore[assignment]
    assert _tool_format(state) == ("deepseekv31", True)
    tag = json.loads(plan_tools(STRICT, "auto", None, "deepseekv31").structural_tag or "")
    assert tag["format"]["triggers"] == ["<｜tool▁call▁begin｜>"]
    assert tag["format"]["tags"][0]["begin"] == "<｜tool▁call▁begin｜>weather<｜tool▁sep｜>"
