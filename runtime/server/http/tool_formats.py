"""Tool-call formats, one class each, registered by name: their markers, how a chat template
names them, how their calls are read (with tool_parser's Cursor), and their structural tag."""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from weft.runtime.server.http.tool_text import INVALID, Cursor, NotACall, Scan, ToolCall, loads

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"  # Hermes / Qwen, anywhere in the text
MISTRAL = "[TOOL_CALLS]"  # Mistral: a JSON array of calls follows, anywhere in the text
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may put it before its JSON call
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4 around a call list
FUNCTION, FUNCTION_END = "<function=", "</function>"  # Qwen3-Coder XML, inside <tool_call>
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
# DeepSeek V3 / V3.1 (fullwidth bars U+FF5C, and U+2581 for the spaces)
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
PYTHONIC_EXAMPLE = "[func_name1(params_name1=params_value1"  # Llama 3.2 / 4 pythonic templates
_CALLS_HEAD = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # how a pythonic list of calls opens
_CALLS_HEAD_START = re.compile(r"(?:\[\s*(?:[A-Za-z_]\w*\s*)?)?")  # ... text that may still


class CallFormat(ABC):
    """How a model writes its calls. Either `markers` open blocks of calls anywhere in the text
    (`block` reads the one at the cursor), or the whole message is the calls (`whole`), or both.
    Both read with a Cursor and return the calls, or raise what the cursor raises: NeedMore
    while more text may still make a call, NotACall once it cannot."""

    name: str
    markers: tuple[str, ...] = ()  # texts that open a block of calls
    tokens: tuple[str, ...] = ()  # marker texts a tokenizer may have as special tokens

    def block(self, c: Cursor) -> list[ToolCall]:
        """The calls of the block at the cursor, which starts with one of `markers`."""
        raise NotACall  # no markers: no blocks

    def whole(self, c: Cursor) -> list[ToolCall]:
        """The calls of an output that is nothing but calls (then read to its end)."""
        raise NotACall  # calls only in blocks

    @abstractmethod
    def in_template(self, template: str) -> bool:
        """Whether a chat template's text asks the model for calls in this format."""

    @abstractmethod
    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any] | None:
        """The structural tag's format node that keeps every call in this format valid (a known
        name, arguments of its JSON schema: `params` maps name -> parameters schema); None
        where no tag can enforce that."""


FORMATS: dict[str, CallFormat] = {}  # by name; a template names the first that it matches


def _register(cls: type[CallFormat]) -> type[CallFormat]:
    FORMATS[cls.name] = cls()
    return cls


@_register
class Mistral(CallFormat):
    """`[TOOL_CALLS] [{"name", "arguments"}, ...]` (or one object) anywhere in the text."""

    name = "mistral"
    markers = tokens = (MISTRAL,)

    def block(self, c: Cursor) -> list[ToolCall]:
        c.lit(MISTRAL)
        c.ws()
        return c.calls(c.json("[{"))

    def in_template(self, template: str) -> bool:
        return MISTRAL in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any]:
        tags = [(f"{MISTRAL} [{_json_head(name)}", schema, "}]") for name, schema in params.items()]
        return _triggered(MISTRAL, tags, parallel)


class _DeepSeek(CallFormat):
    """`<｜tool▁calls▁begin｜>` calls `<｜tool▁calls▁end｜>`, each call within
    `<｜tool▁call▁begin｜>` ... `<｜tool▁call▁end｜>` (a call that opens without the calls marker
    counts too: a structural tag triggers on the call marker)."""

    markers = (CALLS_BEGIN, CALL_BEGIN)
    tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def block(self, c: Cursor) -> list[ToolCall]:
        if c.skip(CALLS_BEGIN):
            c.ws()
        c.lit(CALL_BEGIN)
        call = self._call(c)
        c.ws()
        c.lit(CALL_END)
        end = c.pos
        c.ws()
        if not c.skip(CALLS_END):  # more calls, or text, follow
            c.pos = end
        return [call]

    @abstractmethod
    def _call(self, c: Cursor) -> ToolCall:
        """The call after the call marker, up to the call's end marker."""


@_register
class DeepSeekV3(_DeepSeek):
    """`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```<｜tool▁call▁end｜>`"""

    name = "deepseekv3"

    def _call(self, c: Cursor) -> ToolCall:
        c.lit("function")
        c.lit(SEP)
        name = c.until("\n").strip()
        c.ws()
        c.lit("```json")
        c.ws()
        args = c.json("{")
        c.ws()
        c.lit("```")
        return c.call(name, args)

    def in_template(self, template: str) -> bool:
        return CALLS_BEGIN in template and "```json" in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any]:
        tags = [
            (f"{CALL_BEGIN}function{SEP}{name}\n```json\n", schema, f"\n```{CALL_END}")
            for name, schema in params.items()
        ]
        return _triggered(CALL_BEGIN, tags, parallel)


@_register
class DeepSeekV31(_DeepSeek):
    """`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>`"""

    name = "deepseekv31"

    def _call(self, c: Cursor) -> ToolCall:
        name = c.until(SEP).strip()
        c.ws()
        return c.call(name, c.json("{"))

    def in_template(self, template: str) -> bool:
        return CALLS_BEGIN in template and "```json" not in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any]:
        tags = [(f"{CALL_BEGIN}{name}{SEP}", schema, CALL_END) for name, schema in params.items()]
        return _triggered(CALL_BEGIN, tags, parallel)


@_register
class Qwen3Coder(CallFormat):
    """`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>
    \\n</tool_call>` anywhere in the text. A value is text, read as its parameter's schema says
    (`xml_value`)."""

    name = "qwen3_coder"
    markers = (HERMES_OPEN,)
    tokens = (HERMES_OPEN, HERMES_CLOSE)

    def block(self, c: Cursor) -> list[ToolCall]:
        c.lit(HERMES_OPEN)
        c.ws()
        if not c.ahead(FUNCTION):
            raise NotACall
        start = c.pos
        try:
            inner = c.until(HERMES_CLOSE)
        except NotACall:  # the output ended inside the block: calls if it holds nothing else
            inner, c.pos = c.text[start:], len(c.text)
        c.extent = c.pos
        return self._functions(Cursor(inner, True, Scan(), c.names, c.params))

    def _functions(self, c: Cursor) -> list[ToolCall]:
        calls: list[ToolCall] = []
        while not calls or not c.at_end():
            c.lit(FUNCTION)
            name = c.until(">")
            properties = _properties(c.params.get(name))
            args: dict[str, Any] = {}
            c.ws()
            while not c.skip(FUNCTION_END):
                c.lit(PARAMETER)
                key = c.until(">")
                value = c.until(PARAMETER_END)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = xml_value(value, properties.get(key))
                c.ws()
            calls.append(c.call(name, args))
            c.ws()
        return calls

    def in_template(self, template: str) -> bool:
        return FUNCTION in template or PARAMETER in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> None:
        return None  # arguments are XML text, not JSON: no JSON schema applies to them


@_register
class Hermes(CallFormat):
    """`<tool_call>{"name", "arguments"}</tool_call>` anywhere in the text (Hermes, Qwen 2.5 /
    3); at the output's end the closing tag may be missing."""

    name = "hermes"
    markers = (HERMES_OPEN,)
    tokens = (HERMES_OPEN, HERMES_CLOSE)

    def block(self, c: Cursor) -> list[ToolCall]:
        c.lit(HERMES_OPEN)
        c.ws()
        calls = c.calls(c.json("{"))
        c.ws()
        if not c.skip(HERMES_CLOSE):
            c.end()
        return calls

    def in_template(self, template: str) -> bool:
        return HERMES_OPEN in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any]:
        begin, end = f"{HERMES_OPEN}\n", "}\n" + HERMES_CLOSE
        tags = [(begin + _json_head(name), schema, end) for name, schema in params.items()]
        return _triggered(HERMES_OPEN, tags, parallel)


@_register
class Pythonic(CallFormat):
    """The whole message a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]`
    (Llama 3.2 / 4), maybe within `<|python_start|>` ... `<|python_end|>`."""

    name = "pythonic"
    tokens = (PYTHON_START, PYTHON_END)

    def whole(self, c: Cursor) -> list[ToolCall]:
        c.ws()
        if c.skip(PYTHON_START):
            c.ws()
        if not _CALLS_HEAD.match(c.text, c.pos):  # NOTE: decided early, "[It's ..." is text
            raise c.more() if _CALLS_HEAD_START.fullmatch(c.text, c.pos) else NotACall()
        calls = [c.call(name, args) for name, args in python_calls(c.bracketed("[", True))]
        c.ws()
        c.skip(PYTHON_END)
        c.ws()
        c.end()
        return calls

    def in_template(self, template: str) -> bool:
        return PYTHONIC_EXAMPLE in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> None:
        return None  # arguments are Python literals, not JSON


@_register
class Llama(CallFormat):
    """The whole message one `{"name", "parameters"}` object (Llama 3.1 / 3.2 JSON), maybe
    after `<|python_tag|>`."""

    name = "llama"
    tokens = (PYTHON_TAG,)

    def whole(self, c: Cursor) -> list[ToolCall]:
        c.ws()
        if c.skip(PYTHON_TAG):
            c.ws()
        calls = c.calls(c.json("{"))
        c.ws()
        c.end()
        return calls

    def in_template(self, template: str) -> bool:
        return PYTHON_TAG in template or '"parameters": ' in template

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> dict[str, Any]:
        """No marker opens a call: the call is the whole message. An output that starts with
        `{` (after whitespace) is one call, any other is free text."""
        calls = [
            {"type": "tag", "begin": '{"name": ' + json.dumps(name, ensure_ascii=False)
             + ', "parameters": ', "content": {"type": "json_schema", "json_schema": schema},
             "end": "}"}
            for name, schema in params.items()
        ]  # fmt: skip
        call = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\s*"},
                                                 {"type": "or", "elements": calls}]}  # fmt: skip
        text = {"type": "regex", "pattern": r"(\s*[^\s{][\s\S]*)?"}  # not a call: not from `{`
        return {"type": "or", "elements": [call, text]}


class _AnyJson(CallFormat):
    """What a parser given no format reads: Hermes and Mistral blocks anywhere in the text, or a
    Llama JSON call as the whole message."""

    name = "any_json"
    markers = (HERMES_OPEN, MISTRAL)

    def block(self, c: Cursor) -> list[ToolCall]:
        return (FORMATS["hermes"] if c.ahead(HERMES_OPEN) else FORMATS["mistral"]).block(c)

    def whole(self, c: Cursor) -> list[ToolCall]:
        return FORMATS["llama"].whole(c)

    def in_template(self, template: str) -> bool:
        return False

    def strict_tag(self, params: Mapping[str, Any], parallel: bool) -> None:
        return None


ANY_JSON: CallFormat = _AnyJson()


def template_format(template: str) -> str | None:
    """The name of the first format whose markers the chat template's text holds."""
    return next((name for name, fmt in FORMATS.items() if fmt.in_template(template)), None)


def xml_value(text: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type asks: a string (or an untyped or
    unknown parameter) stays the text; any other type is read as JSON (true / false / null in
    any case), and stays the text where it is no JSON."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not kinds or "string" in kinds:
        return text
    word = text.strip().lower()
    if kinds & {"boolean", "null"} and word in ("true", "false", "null"):
        text = word
    value = loads(text)
    return text if value is INVALID else value


def python_calls(source: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a Python list of calls `[f(a=1), g()]`: plain names, keyword arguments
    only, every value a literal (`ast.literal_eval`); NotACall for any other text."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise NotACall from None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise NotACall
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise NotACall
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                raise NotACall
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise NotACall from None
        calls.append((node.func.id, args))
    return calls


##### Internal Helper Functions #####


def _properties(params: Any) -> Mapping[str, Any]:
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}


def _json_head(name: str) -> str:
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _triggered(trigger: str, tags: list[tuple[str, Any, str]], parallel: bool) -> dict[str, Any]:
    """Free text in which `trigger` opens one of the (begin, arguments schema, end) calls; with
    `parallel` False, the output ends after the first call."""
    return {
        "type": "triggered_tags",
        "triggers": [trigger],
        "tags": [
            {"begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}
            for begin, schema, end in tags
        ],
        "stop_after_first": not parallel,
    }
