"""Tool calls: what tool_choice asks of a chat request (plan, call format, constraint) and the
message pieces of the calls parsed out of its output (`tool_parser`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from weft.constrain import GrammarError, GrammarSpec
from weft.constrain.validation import check_output
from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.tool_formats import FORMATS, template_format
from weft.runtime.server.http.tool_parser import (
    TOOL_CALL_PARSERS,
    Mode,
    ToolCall,
    ToolCallParser,
    ToolFormat,
)


@dataclass(frozen=True)
class ToolPlan:
    """What tools + tool_choice + parallel_tool_calls ask of one chat request."""

    mode: Mode
    tools: list[dict[str, Any]] | None  # for the chat template (None: hidden, as for "none")
    json_schema: str | None  # the constraint that "required" / a named function implies
    parallel: bool = True  # False: at most one call
    named: str | None = None  # the function of a named tool_choice
    strict: bool = False  # a constrained function says strict: refuse unenforceable keywords
    structural_tag: str | None = None  # auto with strict functions: calls constrained in text
    tool_format: ToolFormat = "hermes"  # how the model writes calls (auto reads them so)

    def constraint(self) -> dict[str, Any]:
        """The sampling parameters of the plan's constraint ({} when nothing is constrained)."""
        out: dict[str, Any] = {}
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema
        if self.structural_tag is not None:
            out["structural_tag"] = self.structural_tag
        if out and self.strict:
            out["strict_json_schema"] = True
        return out

    def parameters(self) -> dict[str, Any]:
        """Function name -> its parameters schema (None where it declares none)."""
        return {
            str(t["function"]["name"]): t["function"].get("parameters") for t in self.tools or ()
        }

    def parser(self) -> ToolCallParser | None:
        if self.mode == "none":
            return None
        params = self.parameters()
        fmt = FORMATS[self.tool_format]
        return ToolCallParser(self.mode, frozenset(params), self.named, self.parallel, fmt=fmt,
                              params=params)  # fmt: skip


def plan_tools(
    tools: list[dict[str, Any]] | None,
    choice: str | Mapping[str, Any] | None,
    parallel: bool | None,
    tool_format: ToolFormat = "hermes",
) -> ToolPlan:
    """The ToolPlan of a request's tools (OpenAI dicts) and tool_choice ("none", "auto",
    "required", {"type": "function", "function": {"name"}}, or None: auto when tools are given).
    BadRequest for a bad combination. `strict: true` on a function makes the constraint strict:
    with required, if any tool says so (a refused keyword cannot be traced to one function).
    With auto, calls are parsed out of free text in the model's `tool_format` (`tool_call_format`
    of its chat template, or --tool-call-parser); if a function says strict, a structural tag in
    that format makes every call the model opens hold a valid call: a known name and arguments of
    its schema (as SGLang does; for a Llama-style template: an output that starts with `{` must
    be one call). A format whose arguments are not JSON (qwen3_coder, pythonic) has no such tag:
    strict functions under auto are then a BadRequest, never accepted unenforced."""
    if not tools:
        if choice is not None and choice != "none":
            raise BadRequest("tool_choice is only allowed when tools are given", 400, "tool_choice")
        return ToolPlan("none", None, None)
    if choice == "none":
        return ToolPlan("none", None, None)
    one = parallel is False
    params = {str(t["function"]["name"]): t["function"].get("parameters") for t in tools}
    params = {name: schema or {"type": "object"} for name, schema in params.items()}
    if choice is None or choice == "auto":
        auto = ToolPlan("auto", tools, None, parallel=not one, tool_format=tool_format)
        if not any(t["function"].get("strict") for t in tools):
            return auto
        try:
            tag = tool_call_tag(params, tool_format, parallel=not one)
        except GrammarError as e:
            raise BadRequest(f"tools: {e}", 400, "tools") from None
        if tag is None:
            raise BadRequest(
                f"strict function calling is not enforceable with the {tool_format} tool-call "
                'parser (its call arguments are not JSON): use tool_choice "required" or a '
                "named function (their calls are constrained JSON), or drop strict",
                400,
                "tools",
            )
        return replace(auto, strict=True, structural_tag=tag)
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if one:
            array["maxItems"] = 1
        strict = any(t["function"].get("strict") for t in tools)
        return ToolPlan("required", tools, json.dumps(array), parallel=not one, strict=strict)
    assert isinstance(choice, Mapping), choice
    name = str(choice["function"]["name"])
    if name not in params:
        raise BadRequest(f"tool_choice names function {name!r}, not in tools", 400, "tool_choice")
    strict = any(t["function"].get("strict") for t in tools if t["function"]["name"] == name)
    schema = json.dumps(params[name])
    return ToolPlan("named", tools, schema, parallel=False, named=name, strict=strict)


def tool_call_format(chat_template: str | Mapping[str, str] | None) -> ToolFormat:
    """The tool-call format a chat template asks of the model: the first format of
    tool_formats.FORMATS whose markers its text holds (mistral `[TOOL_CALLS]`; deepseekv3 /
    deepseekv31 `<｜tool▁calls▁begin｜>`, with or without a ```json fence; qwen3_coder
    `<function=` / `<parameter=`; hermes `<tool_call>`; pythonic `[func_name1(params_name1=...`;
    llama `<|python_tag|>` or `"parameters": `), else "hermes" (the parser's default too)."""
    if isinstance(chat_template, Mapping):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    return cast(ToolFormat, template_format(chat_template or "") or "hermes")


def resolve_tool_format(parser: str, chat_template: str | Mapping[str, str] | None) -> ToolFormat:
    """The call format of `--tool-call-parser`: the one it names, or for "auto" the one the chat
    template names (`tool_call_format`)."""
    fmt = TOOL_CALL_PARSERS[parser]
    return tool_call_format(chat_template) if fmt is None else fmt


def markers_are_special(tokenizer: Any) -> bool:
    """Whether one of the tool-call markers of any format is a special token of the tokenizer
    (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>` / `<|python_start|>`, DeepSeek's
    `<｜tool▁calls▁begin｜>` ...): detokenizing must then keep special tokens, or the parser
    never sees where a call begins (SGLang does the same)."""
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    return any(m in special for fmt in FORMATS.values() for m in fmt.tokens)


def tool_call_tag(
    params: Mapping[str, Any], tool_format: ToolFormat, parallel: bool = True
) -> str | None:
    """A structural tag (xgrammar's format form, canonical JSON) for calls in `tool_format`:
    free text, in which the format's marker opens a call of one of the functions of `params`
    (name -> parameters schema) with arguments of its schema; with `parallel` False, the output
    ends after the first call. "llama": no marker opens a call, the call is the whole message.
    None for a format whose arguments no JSON schema can constrain."""
    node = FORMATS[tool_format].strict_tag(params, parallel)
    if node is None:
        return None
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": node}).spec


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when calls were returned, except that "length" (and
    "abort") stay as they are: a cut-off output may carry calls completed before the cut."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def split_output(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: content None when the output was only tool calls."""
    pieces = parser.feed(text) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = "".join(p for p in pieces if isinstance(p, str))
    return (None if calls and not content else content), calls


def stream_deltas(parser: ToolCallParser, text: str, final: bool) -> list[dict[str, Any]]:
    """The chat-stream deltas for the next piece of output text (`final` on its last): content
    text, and each call whole in one delta, indexed among the choice's calls."""
    index = parser.num_calls
    deltas: list[dict[str, Any]] = []
    for piece in parser.feed(text) + (parser.finish() if final else []):
        if isinstance(piece, str):
            deltas.append({"content": piece})
        else:
            deltas.append({"tool_calls": [piece.openai(index=index)]})
            index += 1
    return deltas


def check_arguments(plan: ToolPlan, entries: list[dict[str, Any]]) -> None:
    """Each OpenAI tool-call entry (message.tool_calls[i] or a streamed delta's) gets
    `schema_valid`, its arguments validated against its function's parameters schema with the
    full validator (constrain/validation.py: what the grammar, if any, left unenforced is caught
    here), and unless true `schema_error`; entries of a function without parameters are left as
    they are. Blocking: run it on a tokenizer thread."""
    params = plan.parameters()
    texts: dict[str, str] = {}  # each function's schema serialised once
    for entry in entries:
        function = entry.get("function") or {}
        name = str(function.get("name"))
        schema = params.get(name)
        if schema is not None:
            if name not in texts:
                texts[name] = json.dumps(schema, sort_keys=True)
            arguments = function.get("arguments") or ""
            entry.update(check_output(texts[name], arguments).meta())
