"""Tool calls parsed out of a chat output, incrementally: the scanner that splits an output into
content and calls for one call format (`tool_formats`), and the cursor formats read text with."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from weft.runtime.server.http.tool_formats import CallFormat

Mode = Literal["none", "auto", "required", "named"]
# how a model writes its calls (a format of tool_formats.FORMATS)
ToolFormat = Literal[
    "hermes", "mistral", "llama", "qwen3_coder", "pythonic", "deepseekv3", "deepseekv31"
]
# --tool-call-parser (SGLang's names): a format, or "auto": the one the chat template names
TOOL_CALL_PARSERS: dict[str, ToolFormat | None] = {
    "auto": None,
    "hermes": "hermes",
    "qwen25": "hermes",
    "mistral": "mistral",
    "llama3": "llama",
    "qwen3_coder": "qwen3_coder",
    "pythonic": "pythonic",
    "deepseekv3": "deepseekv3",
    "deepseekv31": "deepseekv31",
}


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


class ToolCallParser:
    """Separates tool calls from content, incrementally: `feed` returns the pieces (content text
    or complete calls, in order) that can be released now and holds back text that may still be
    a call; `finish` releases the rest. A whole output goes through the same path as a stream,
    so both give the same message.

    A call counts once it is complete, names a function in `names` and has an object of
    arguments; any other text (malformed or cut-off calls, unknown functions) is content.
    Whitespace next to calls is dropped; with no calls the content is the text exactly. With
    parallel False, calls after the first are dropped.

    required: the whole output is a JSON array of {"name", "parameters"} (the constraint's
    shape); named: the whole output is the arguments object; auto: calls in `fmt` (a format of
    tool_formats; `params` maps names to parameters schemas, for formats whose arguments are
    text). Without a format: Hermes / Qwen `<tool_call>` blocks and Mistral `[TOOL_CALLS]`
    anywhere in the text, or a Llama 3.1 JSON call as the whole message."""

    def __init__(
        self,
        mode: Mode,
        names: frozenset[str],
        named: str | None = None,
        parallel: bool = True,
        fmt: CallFormat | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        assert mode != "none" and (mode == "named") == (named is not None)
        if fmt is None:
            from weft.runtime.server.http.tool_formats import ANY_JSON  # NOTE: it imports us

            fmt = ANY_JSON
        self.mode = mode
        self.names = names
        self.named = named
        self.parallel = parallel
        self.fmt = fmt
        self.params = params or {}
        self.num_calls = 0
        self._buf = ""  # text not released yet
        self._ws = ""  # trailing whitespace of released content, held until text follows
        self._at_start = True  # auto: nothing released yet, the output may be calls only
        self._scan = Scan()  # searches in self._buf; renewed when its front is consumed

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        self._scan_buf(False, out)
        return out

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._scan_buf(True, out)
        self._text(self._consume(len(self._buf)), out)  # what was held and never completed
        if self._ws and not self.num_calls:
            out.append(self._ws)
        self._ws = ""
        return out

    ##### Internal Helper Functions #####

    def _scan_buf(self, final: bool, out: list[str | ToolCall]) -> None:
        if self.mode == "auto":
            self._scan_auto(final, out)
            return
        if not final:  # NOTE: the constraint ends the output where the JSON ends: no wait
            return
        c = self._cursor(final)
        try:
            c.ws()
            value = c.json()
            c.ws()
            c.end()
            named = [c.call(self.named, value)] if self.named is not None else None
            calls = named or c.calls(value, list_only=True)
        except NotACall:  # content (finish releases it)
            return
        self._consume(len(self._buf))
        for call in calls:
            self._call(call, out)

    def _scan_auto(self, final: bool, out: list[str | ToolCall]) -> None:
        markers = self.fmt.markers
        while self._buf:
            if self._at_start:
                if not self._scan_whole(final, out):
                    return
                continue
            at = min((i for i in (self._buf.find(m) for m in markers) if i >= 0), default=-1)
            if at < 0:
                keep = 0 if final else _held_suffix(self._buf, markers)
                self._text(self._consume(len(self._buf) - keep), out)
                return
            self._text(self._consume(at), out)
            c = self._cursor(final)
            try:
                calls = self.fmt.block(c)
            except NeedMore:  # the block is not complete yet
                return
            except NotACall:  # content: the marker, or the block as far as it is known
                opener = max((len(m) for m in markers if self._buf.startswith(m)), default=1)
                self._text(self._consume(max(c.extent, opener)), out)
                continue
            assert c.pos > 0, self.fmt.name
            self._consume(c.pos)
            for call in calls:
                self._call(call, out)

    def _scan_whole(self, final: bool, out: list[str | ToolCall]) -> bool:
        """Auto, at the start: calls as the whole message. False while that is still open;
        True once decided (the output then goes on as text, or is done)."""
        c = self._cursor(final)
        try:
            calls = self.fmt.whole(c)
        except NeedMore:
            return False
        except NotACall:
            calls = None
        self._at_start = False
        if calls is not None:
            self._consume(len(self._buf))
            for call in calls:
                self._call(call, out)
        return True

    def _cursor(self, final: bool) -> Cursor:
        return Cursor(self._buf, final, self._scan, self.names, self.params)

    def _consume(self, n: int) -> str:
        """Takes the buffer's first n characters off."""
        head, self._buf = self._buf[:n], self._buf[n:]
        if n:
            self._scan = Scan()
        return head

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


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of text's longest suffix that may be the start of a marker."""
    for n in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
