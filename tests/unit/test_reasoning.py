"""Reasoning parsers (--reasoning-parser): finished outputs split into (reasoning, answer) as
DeepSeek-R1 and Qwen3 write them, and the same outputs streamed in pieces cut at every position
(markers split across pieces never leak into either field)."""

from __future__ import annotations

import pytest

from weft.runtime.server.reasoning import (
    ReasoningStream,
    reasoning_format,
    split_reasoning,
    think_markers_special,
)

R1 = reasoning_format("deepseek-r1")
QWEN3 = reasoning_format("qwen3")

# (text, deepseek-r1's split, qwen3's split)
CASES = [
    # complete, with the opening tag (Qwen3, DeepSeek-R1-0528)
    ("<think>\nLet me see.\n</think>\n\nThe answer is 42.", ("\nLet me see.\n", "\n\nThe answer is 42."),
     ("\nLet me see.\n", "\n\nThe answer is 42.")),
    # without the opening tag (the template put it in the prompt): reasoning for R1 only
    ("Let me see.</think>42", ("Let me see.", "42"), (None, "Let me see.</think>42")),
    # unterminated reasoning (cut short by max_tokens): all reasoning
    ("<think>still thinking", ("still thinking", ""), ("still thinking", "")),
    ("still thinking", ("still thinking", ""), (None, "still thinking")),
    # empty reasoning
    ("<think></think>42", ("", "42"), ("", "42")),
    ("</think>42", ("", "42"), (None, "</think>42")),
    ("<think>\n\n</think>\n\n{\"a\": 1}", ("\n\n", "\n\n{\"a\": 1}"), ("\n\n", "\n\n{\"a\": 1}")),
    # text after the end marker is the answer as is (a second marker included)
    ("<think>a</think>b</think>c<think>d", ("a", "b</think>c<think>d"), ("a", "b</think>c<think>d")),
    # leading whitespace before the opening tag
    ("\n<think>a</think>b", ("a", "b"), ("a", "b")),
    # no reasoning at all
    ("", ("", ""), (None, "")),
    ("Plain answer.", ("Plain answer.", ""), (None, "Plain answer.")),
    # a '<' that is no marker
    ("a < b</think>c <", ("a < b", "c <"), (None, "a < b</think>c <")),
    ("<thinking>x", ("<thinking>x", ""), (None, "<thinking>x")),
    # only the start of a marker, then the end of the output
    ("<thi", ("<thi", ""), (None, "<thi")),
    ("<think>ab</thi", ("ab</thi", ""), ("ab</thi", "")),
    ("<think>", ("", ""), ("", "")),
]  # fmt: skip


@pytest.mark.parametrize("text,r1,qwen3", CASES)
def test_split_finished_outputs(text: str, r1: tuple, qwen3: tuple) -> None:
    assert split_reasoning(R1, text) == r1
    assert split_reasoning(QWEN3, text) == qwen3


def streamed(fmt_name: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    stream = ReasoningStream(reasoning_format(fmt_name))
    out = [stream.feed(p) for p in pieces] + [stream.finish()]
    return "".join(r for r, _ in out), "".join(a for _, a in out), out


@pytest.mark.parametrize("fmt_name", ["deepseek-r1", "qwen3"])
@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_stream_cut_at_every_position_equals_the_split(fmt_name: str, text: str) -> None:
    fmt = reasoning_format(fmt_name)
    reasoning, answer = split_reasoning(fmt, text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got_r, got_a, _ = streamed(fmt_name, [text[:i], text[i:j], text[j:]])
            assert (got_r, got_a) == (reasoning or "", answer), (i, j)
    # one character at a time
    got_r, got_a, _ = streamed(fmt_name, list(text))
    assert (got_r, got_a) == (reasoning or "", answer)


def test_no_marker_text_is_ever_released() -> None:
    """Every released piece is free of marker fragments: `</thi` is held until decided."""
    text = "<think>I think</think>The answer"
    _, _, pieces = streamed("qwen3", list(text))
    assert all("<" not in r and "<" not in a for r, a in pieces)
    _, _, pieces = streamed("deepseek-r1", list("reason</think>answer"))
    assert [p for p in pieces if p != ("", "")] == [
        ("r", ""), ("e", ""), ("a", ""), ("s", ""), ("o", ""), ("n", ""), ("", "a"),
        ("", "n"), ("", "s"), ("", "w"), ("", "e"), ("", "r"),
    ]  # fmt: skip


def test_stream_releases_reasoning_as_it_comes() -> None:
    stream = ReasoningStream(QWEN3)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>Hmm, ") == ("Hmm, ", "")
    assert stream.feed("so </") == ("so ", "")
    assert stream.feed("think>\n\nYes") == ("", "\n\nYes")
    assert stream.feed(" <think>") == ("", " <think>")
    assert stream.finish() == ("", "")
    plain = ReasoningStream(QWEN3)
    assert plain.feed("Hello") == ("", "Hello")
    assert plain.feed("</think>") == ("", "</think>")


def test_unknown_parser_and_thinking_switch() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek-r1, qwen3"):
        reasoning_format("gpt-oss")
    assert QWEN3.thinking(None) and QWEN3.thinking({"enable_thinking": True})
    assert not QWEN3.thinking({"enable_thinking": False})
    assert R1.thinking({"enable_thinking": False})


def test_special_markers_are_detected() -> None:
    class Tok:
        all_special_tokens = ["<s>", "</think>"]

    assert think_markers_special(Tok(), QWEN3)
    Tok.all_special_tokens = ["<s>"]
    assert not think_markers_special(Tok(), QWEN3)


def test_config_and_cli_option() -> None:
    from weft.runtime.config import EngineConfig

    assert EngineConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="r1")  # type: ignore[arg-type]
