"""Tool calls parsed out of a chat output, incrementally: Hermes / Qwen, Mistral and Llama 3.x
formats, and the JSON shapes that tool_choice required / a named function constrain."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["none", "auto", "required", "named"]
ToolFormat = Literal["hermes", "mistral", "llama"]  # how a model writes its calls
# --tool-call-parser (SGLang's names): a format, or "auto": the one the chat template names
TOOL_CALL_PARSERS: dict[str, ToolFormat | None] = {
    "auto": None,
    "hermes": "hermes",
    "qwen25": "hermes",
    "mistral": "mistral",
    "llama3": "llama",
}

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"  # Hermes / Qwen, anywhere in the text
MISTRAL = "[TOOL_CALLS]"  # Mistral: a JSON array of calls follows, anywhere in the text
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may put it before its JSON call
_MARKERS = (HERMES_OPEN, MISTRAL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as compact JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """message.tool_calls[i]; with index, the entry of a streamed delta."""
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class ToolCallParser:
    """Separates tool calls from content, incrementally: `feed` returns the pieces (content text
    or complete calls, in order) that can be released now and holds back text that may still be
    a call; `finish` releases the rest. A whole output goes through the same path as a stream,
    so both give the same message.

    Only complete JSON is parsed: a call counts once its JSON is complete, names a function in
    `tools` and has an object of arguments; any other text (malformed or cut-off JSON, unknown
    functions) is content. Whitespace next to calls is dropped; with no calls the content is the
    text exactly. With parallel False, calls after the first are dropped.

    required: the whole output is a JSON array of {"name", "parameters"} (the constraint's
    shape); named: the whole output is the arguments object; auto: Hermes/Qwen
    `<tool_call>{"name", "arguments"}</tool_call>` blocks and Mistral `[TOOL_CALLS][{...}, ...]`
    anywhere in the text, or a Llama 3.1 `{"name", "parameters"}` object as the whole message."""

    def __init__(
        self, mode: Mode, names: frozenset[str], named: str | None = None, parallel: bool = True
    ) -> None:
        assert mode != "none" and (mode == "named") == (named is not None)
        self.mode = mode
        self.names = names
        self.named = named
        self.parallel = parallel
        self.num_calls = 0
        self._buf = ""  # text not released yet
        self._ws = ""  # trailing whitespace of released content, held until text follows
        self._at_start = True  # auto: nothing released yet, the output may be one JSON call
        self._json: _JsonEnd | None = None  # scans self._buf; dropped when its front is consumed

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        self._scan(False, out)
        return out

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._scan(True, out)
        self._text(self._consume(len(self._buf)), out)  # what was held and never completed
        if self._ws and not self.num_calls:
            out.append(self._ws)
        self._ws = ""
        return out

    ##### Internal Helper Functions #####

    def _scan(self, final: bool, out: list[str | ToolCall]) -> None:
        if self.mode == "auto":
            self._scan_auto(final, out)
            return
        if not final:  # NOTE: the constraint ends the output where the JSON ends: no wait
            return
        start = _skip_ws(self._buf, 0)
        end = self._json_end(start)
        if end is None:  # cut off: content (finish releases it)
            return
        calls = self._constrained_calls(self._buf[start:end])
        if calls is None or self._buf[end:].strip():
            self._text(self._consume(len(self._buf)), out)
            return
        self._consume(len(self._buf))
        for call in calls:
            self._call(call, out)

    def _constrained_calls(self, text: str) -> list[ToolCall] | None:
        value = _loads(text)
        if self.mode == "named":
            assert self.named is not None
            return [_make_call(self.named, value)] if isinstance(value, dict) else None
        return _calls_of(value, self.names, list_only=True)

    def _scan_auto(self, final: bool, out: list[str | ToolCall]) -> None:
        while self._buf:
            if self._at_start:
                if not self._scan_whole_message(final, out):
                    return
                continue
            at = min((i for i in (self._buf.find(m) for m in _MARKERS) if i >= 0), default=-1)
            if at < 0:
                keep = 0 if final else _held_suffix(self._buf)
                self._text(self._consume(len(self._buf) - keep), out)
                return
            self._text(self._consume(at), out)
            if self._buf.startswith(HERMES_OPEN):
                end, calls = self._hermes_block(final)
            else:
                end, calls = self._mistral_block()
            if end is None:  # the block is not complete yet (at the end: content)
                return
            block = self._consume(end)
            if calls is None:
                self._text(block, out)
            for call in calls or ():
                self._call(call, out)

    def _scan_whole_message(self, final: bool, out: list[str | ToolCall]) -> bool:
        """Auto, at the start: a Llama-style JSON call as the whole message. False while that
        is still open; True once decided (the output then continues as plain text)."""
        buf = self._buf
        start = _skip_ws(buf, 0)
        if buf.startswith(PYTHON_TAG, start):
            start = _skip_ws(buf, start + len(PYTHON_TAG))
        elif (
            not final
            and 0 < len(buf) - start < len(PYTHON_TAG)
            and PYTHON_TAG.startswith(buf[start:])
        ):
            return False
        if start == len(buf) and not final:
            return False
        end = self._json_end(start) if buf.startswith("{", start) else None
        if end is None and buf.startswith("{", start) and not final:
            return False
        calls = None if end is None else _calls_of(_loads(buf[start:end]), self.names)
        if calls is not None and not buf[end:].strip():
            if not final:
                return False  # a call, if nothing but whitespace follows
            self._consume(len(buf))
            self._call(calls[0], out)
        self._at_start = False
        return True

    def _hermes_block(self, final: bool) -> tuple[int | None, list[ToolCall] | None]:
        """`<tool_call>{json}</tool_call>` at the start of the buffer: (its end, its call or None
        when it is no call); end None while incomplete. At the output's end the closing tag may
        be missing."""
        buf = self._buf
        start = _skip_ws(buf, len(HERMES_OPEN))
        if start < len(buf) and buf[start] != "{":
            return len(HERMES_OPEN), None
        end = self._json_end(start)
        if end is None:
            return None, None
        calls = _calls_of(_loads(buf[start:end]), self.names)
        after = _skip_ws(buf, end)
        if buf.startswith(HERMES_CLOSE, after):
            return after + len(HERMES_CLOSE), calls
        if HERMES_CLOSE.startswith(buf[after:]) and not final:
            return None, None  # the closing tag may still come
        return end, (calls if after == len(buf) else None)

    def _mistral_block(self) -> tuple[int | None, list[ToolCall] | None]:
        """`[TOOL_CALLS][{...}, ...]` at the start of the buffer: (end, calls or None)."""
        buf = self._buf
        start = _skip_ws(buf, len(MISTRAL))
        if start < len(buf) and buf[start] not in "[{":
            return len(MISTRAL), None
        end = self._json_end(start)
        return end, (None if end is None else _calls_of(_loads(buf[start:end]), self.names))

    def _consume(self, n: int) -> str:
        """Takes the buffer's first n characters off."""
        head, self._buf = self._buf[:n], self._buf[n:]
        if n:
            self._json = None
        return head

    def _json_end(self, start: int) -> int | None:
        if self._json is None or self._json.start != start:
            self._json = _JsonEnd(start)
        return self._json.end(self._buf)

    def _text(self, text: str, out: list[str | ToolCall]) -> None:
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append(body)

    def _call(self, call: ToolCall, out: list[str | ToolCall]) -> None:
        self._ws = ""
        if self.parallel or not self.num_calls:
            out.append(call)
            self.num_calls += 1


class _JsonEnd:
    """Where the JSON object or array opening at text[start] closes (by bracket balance, strings
    skipped). Each call resumes where the last one stopped, so a text that only grows is scanned
    once: a stream costs O(n), not O(n^2)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = self._escaped = False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        if self.start >= len(text) or text[self.start] not in "[{":
            return None
        if self._end is not None:
            return self._end
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(self._pos, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            elif ch in "]}":
                depth -= 1
                if depth == 0:
                    self._end = i + 1
                    return self._end
        self._pos, self._depth, self._in_string, self._escaped = (
            len(text),
            depth,
            in_string,
            escaped,
        )
        return None


def _calls_of(value: Any, names: frozenset[str], list_only: bool = False) -> list[ToolCall] | None:
    """Calls from a parsed {"name", "arguments" | "parameters"} object or a list of them; None
    unless every one is a call of a known function with an object of arguments."""
    items = value if isinstance(value, list) else None if list_only else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments as a JSON string
            args = _loads(args)
        if not isinstance(args, dict):
            return None
        calls.append(_make_call(str(item["name"]), args))
    return calls


def _make_call(name: str, arguments: Mapping[str, Any]) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


_INVALID = object()  # what _loads gives for text that is not JSON


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _held_suffix(text: str) -> int:
    """The length of text's longest suffix that may be the start of a marker."""
    for n in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in _MARKERS):
            return n
    return 0
