"""Reasoning parsers (`--reasoning-parser`, SGLang's names): the text between a reasoning model's
think markers, split from its answer, whole or as the output streams.

    deepseek-r1   the output starts inside the reasoning (the chat template wrote `<think>` into
                  the prompt); a leading `<think>` is dropped if the model writes it anyway
    qwen3         the reasoning opens only with `<think>` at the start of the output (leading
                  whitespace allowed); an output without it is all answer (enable_thinking off)

Either way the reasoning runs to the first `</think>`; everything after it is the answer, as is.
An output that ends before `</think>` is all reasoning (cut short by max_tokens or a stop).
Neither marker is ever part of either field. NOTE: SGLang's non-streaming split also opens the
reasoning at a `<think>` in the middle of a qwen3 output; here a split is always what the stream
of the same text gives, cut anywhere.
"""

from __future__ import annotations

from typing import Any, Literal

from weft.constrain.reasoning import (  # the markers: the grammar layer's (the scheduler's too)
    REASONING_PARSERS,
    ReasoningFormat,
    ReasoningParserName,
    reasoning_format,
)

__all__ = ["REASONING_PARSERS", "ReasoningFormat", "ReasoningParserName", "reasoning_format"]


class ReasoningStream:
    """Splits an output that arrives in pieces: `feed` returns the (reasoning, answer) text that
    is certain so far; text that may be the start of a marker (`</thi`) is held back until the
    next piece decides it, and `finish` releases what is still held when the output ends."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state: Literal["start", "reasoning", "answer"] = "start"
        self.held = ""  # text not yet given to either field
        self.saw_reasoning = False  # a reasoning section was opened (even an empty one)

    def feed(self, text: str) -> tuple[str, str]:
        held = self.held + text
        self.held = ""
        if self.state == "answer":
            return "", held
        if self.state == "start":
            opened = held.lstrip()
            if opened.startswith(self.fmt.start):
                held = opened[len(self.fmt.start) :]
            elif self.fmt.start.startswith(opened):  # undecided: maybe the marker comes
                self.held = held
                return "", ""
            elif not self.fmt.starts_inside:
                self.state = "answer"
                return "", held
            self.state = "reasoning"
            self.saw_reasoning = True
        at = held.find(self.fmt.end)
        if at >= 0:
            self.state = "answer"
            return held[:at], held[at + len(self.fmt.end) :]
        keep = _partial_suffix(held, self.fmt.end)
        self.held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The held text, once the output has ended: reasoning unless the answer had begun."""
        held, self.held = self.held, ""
        if self.state == "start":
            if not self.fmt.starts_inside:
                self.state = "answer"
                return "", held
            self.state = "reasoning"
            self.saw_reasoning = True
            if held.lstrip() == self.fmt.start:  # "<think>" alone: an empty reasoning
                held = ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a finished output; reasoning is None when the output opens no
    reasoning section (an empty one: "")."""
    stream = ReasoningStream(fmt)
    reasoning, answer = stream.feed(text)
    more_reasoning, more_answer = stream.finish()
    if not stream.saw_reasoning:
        return None, answer + more_answer
    return reasoning + more_reasoning, answer + more_answer


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def think_markers_special(tokenizer: Any, fmt: ReasoningFormat) -> bool:
    """Whether the tokenizer holds a marker as a special token, which plain detokenizing
    (skip_special_tokens) would drop: the chat route then keeps special tokens in the text."""
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return fmt.start in specials or fmt.end in specials
