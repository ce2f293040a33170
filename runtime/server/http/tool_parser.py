"""Tool calls parsed out of a chat output, incrementally: the scanner that splits an output into
content and calls for one call format (`tool_formats`, which read with tool_text's Cursor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from weft.runtime.server.http.tool_text import Cursor, NeedMore, NotACall, Scan, ToolCall

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
    text); tool_formats.ANY_JSON reads Hermes / Qwen `<tool_call>` blocks and Mistral
    `[TOOL_CALLS]` anywhere in the text, or a Llama 3.1 JSON call as the whole message."""

    def __init__(
        self,
        mode: Mode,
        names: frozenset[str],
        named: str | None = None,
        parallel: bool = True,
        *,
        fmt: CallFormat,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        assert mode != "none" and (mode == "named") == (named is not None)
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


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of text's longest suffix that may be the start of a marker."""
    for n in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
