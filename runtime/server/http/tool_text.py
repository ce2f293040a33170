"""The reading side of tool-call parsing: a parsed call, the cursor that call formats read text
with (`tool_formats`), the resumable searches behind it, and JSON in and out."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


class NeedMore(Exception):
    """The text ends where more text may still make a call: wait (never at the output's end)."""


class NotACall(Exception):
    """The text at the cursor is no call of the format."""


class Cursor:
    """Reads a format's calls off the start of a text. `final`: the text is the whole rest of
    the output; `extent`: how far the block is known to reach (the end of its JSON or of its
    closing tag), so that a block that is no call is content up to there."""

    def __init__(
        self, text: str, final: bool, scan: Scan, names: frozenset[str], params: Mapping[str, Any]
    ) -> None:
        self.text = text
        self.final = final
        self.scan = scan
        self.names = names
        self.params = params  # function name -> its parameters schema
        self.pos = 0
        self.extent = 0

    def more(self) -> Exception:
        """What a read that runs off the text raises."""
        return NotACall() if self.final else NeedMore()

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def ws(self) -> None:
        self.pos = _skip_ws(self.text, self.pos)

    def ahead(self, lit: str) -> bool:
        """Whether `lit` comes next (not consumed)."""
        rest = self.text[self.pos : self.pos + len(lit)]
        if len(rest) < len(lit) and lit.startswith(rest) and not self.final:
            raise NeedMore
        return rest == lit

    def skip(self, lit: str) -> bool:
        """Consumes `lit` if it comes next."""
        if self.ahead(lit):
            self.pos += len(lit)
            return True
        return False

    def lit(self, lit: str) -> None:
        if not self.skip(lit):
            raise NotACall

    def until(self, lit: str) -> str:
        """The text up to the next `lit`, which is consumed too."""
        at = self.scan.find(self.text, lit, self.pos)
        if at < 0:
            raise self.more()
        head, self.pos = self.text[self.pos : at], at + len(lit)
        return head

    def json(self, opens: str = "{[") -> Any:
        """The JSON value whose bracket (one of `opens`) opens here; INVALID if it is no JSON."""
        return loads(self.bracketed(opens, python=False))

    def bracketed(self, opens: str, python: bool) -> str:
        """The text from the bracket that opens here to the one that closes it."""
        if self.at_end():
            raise self.more()
        if self.text[self.pos] not in opens:
            raise NotACall
        end = self.scan.bracket_end(self.text, self.pos, python)
        if end is None:
            raise self.more()
        head, self.pos = self.text[self.pos : end], end
        self.extent = max(self.extent, end)
        return head

    def end(self) -> None:
        """The output ends here (so, until it has ended, more text may follow)."""
        if not self.at_end():
            raise NotACall
        if not self.final:
            raise NeedMore

    def calls(self, value: Any, list_only: bool = False) -> list[ToolCall]:
        """The calls of a parsed {"name", "arguments" | "parameters"} object or list of them:
        every one a call of a known function with an object of arguments."""
        items = value if isinstance(value, list) else None if list_only else [value]
        if not items or not all(isinstance(item, dict) for item in items):
            raise NotACall
        calls = []
        for item in items:
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):  # some models send the arguments as a JSON string
                args = loads(args)
            calls.append(self.call(item.get("name"), args))
        return calls

    def call(self, name: Any, arguments: Any) -> ToolCall:
        """A call of the function `name` (one of the tools) with an object of arguments."""
        text = dumps(arguments) if isinstance(arguments, dict) else None
        if not isinstance(name, str) or name not in self.names or text is None:
            raise NotACall
        return ToolCall(name, text)


class Scan:
    """Searches in the parser's buffer that resume where they last stopped: between two
    consumptions the buffer only grows (the parser then starts a new Scan), so a stream is
    scanned once, O(n), however finely it is cut."""

    def __init__(self) -> None:
        self._brackets: dict[tuple[int, bool], _BracketEnd] = {}
        self._from: dict[tuple[str, int], int] = {}  # a search not found yet: resume here
        self._hits: dict[tuple[str, int], int] = {}

    def find(self, text: str, needle: str, start: int) -> int:
        key = (needle, start)
        if key in self._hits:
            return self._hits[key]
        at = text.find(needle, self._from.get(key, start))
        if at < 0:
            self._from[key] = max(start, len(text) - len(needle) + 1)
        else:
            self._hits[key] = at
        return at

    def bracket_end(self, text: str, start: int, python: bool) -> int | None:
        key = (start, python)
        if key not in self._brackets:
            self._brackets[key] = _BracketEnd(start, python)
        return self._brackets[key].end(text)


class _BracketEnd:
    """Where the bracket opening at text[start] closes, by bracket balance with strings skipped:
    JSON's (`"`, `[]{}`) or Python's (`'`, `"`, triple quotes, `()[]{}`). Each call resumes where
    the last one stopped, so a text that only grows is scanned once."""

    def __init__(self, start: int, python: bool) -> None:
        self.start = start
        self._quotes = "\"'" if python else '"'
        self._opens, self._closes = ("([{", ")]}") if python else ("[{", "]}")
        self._python = python
        self._pos = start
        self._depth = 0
        self._quote = ""  # the delimiter of the string the scan is in
        self._escaped = False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        if self.start >= len(text) or text[self.start] not in self._opens:
            return None
        i, n = self._pos, len(text)
        while self._end is None and i < n:
            ch = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote[0]:
                    if len(self._quote) == 3 and i + 3 > n:
                        break  # may close a triple-quoted string: wait for the rest
                    if text.startswith(self._quote, i):
                        i += len(self._quote) - 1
                        self._quote = ""
            elif ch in self._quotes:
                if self._python and i + 3 > n:
                    break  # a triple quote or not: wait for the rest
                self._quote = ch * 3 if self._python and text.startswith(ch * 3, i) else ch
                i += len(self._quote) - 1
            elif ch in self._opens:
                self._depth += 1
            elif ch in self._closes:
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
            i += 1
        self._pos = i
        return self._end


INVALID = object()  # what loads gives for text that is not JSON


def loads(text: str) -> Any:
    """The JSON value of text, or INVALID (NaN and Infinity are no JSON)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return INVALID


def dumps(arguments: Any) -> str | None:
    """Arguments as JSON text; None where they have no JSON form."""
    try:
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
