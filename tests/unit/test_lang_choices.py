"""select's choices methods (pure functions) and the native backends' choice scoring requests."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from weft.lang.backends.base import Context, SelectRequest
from weft.lang.backends.native import NativeBackend
from weft.lang.backends.openai import _choice_logprobs
from weft.lang.choices import (
    argmax_first,
    greedy_token_selection,
    normalized_logprob,
    token_length_normalized,
    unconditional_likelihood_normalized,
)


def entries(*lps: float | None) -> list[tuple[float | None, int, str | None]]:
    return [(lp, i, f"t{i}") for i, lp in enumerate(lps)]


def decide(method: Any, rows: list[Any], uncond: list[Any] | None = None) -> str:
    choices = [f"c{i}" for i in range(len(rows))]
    return method(
        choices=choices,
        normalized_prompt_logprobs=[normalized_logprob(r) for r in rows],
        input_token_logprobs=rows,
        output_token_logprobs=[[] for _ in rows],
        unconditional_token_logprobs=uncond,
    ).decision


def test_normalized_logprob_skips_none_and_keeps_zero() -> None:
    assert normalized_logprob(entries(None, -1.0, 0.0)) == -0.5
    assert normalized_logprob(entries(None)) == -math.inf
    assert argmax_first([1.0, 3.0, 3.0]) == 1 and argmax_first([]) == 0


def test_token_length_normalized_prefers_the_best_mean_and_ties_go_first() -> None:
    assert decide(token_length_normalized, [entries(-2.0, -2.0), entries(-1.0, -3.0, -0.5)]) == "c1"
    assert decide(token_length_normalized, [entries(-1.0), entries(-0.5, -1.5)]) == "c0"


def test_greedy_token_selection_eliminates_column_by_column() -> None:
    rows = [entries(-1.0, -5.0), entries(-1.0, -0.5, -9.0), entries(-2.0, 0.0)]
    # column 0 keeps c0 and c1 (c2 is worse); column 1 keeps c1
    assert decide(greedy_token_selection, rows) == "c1"
    # a shorter choice is padded with its own mean: c0 = [-1, -1], c1 = [-1, -2]
    assert decide(greedy_token_selection, [entries(-1.0), entries(-1.0, -2.0)]) == "c0"
    assert decide(greedy_token_selection, [entries(-1.0), entries(-1.0)]) == "c0"


def test_unconditional_likelihood_normalized() -> None:
    cond = [entries(-1.0, -1.0), entries(-2.0, -2.0)]
    uncond = [entries(None, -0.1), entries(None, -3.0)]
    # c0: mean(-1 - 0, -1 + 0.1) = -0.95; c1: mean(-2 - 0, -2 + 3) = -0.5
    assert decide(unconditional_likelihood_normalized, cond, uncond) == "c1"
    with pytest.raises(ValueError, match="2 conditional but 1 unconditional"):
        decide(unconditional_likelihood_normalized, cond, [entries(None), entries(None)])
    with pytest.raises(ValueError, match="needs unconditional logprobs"):
        decide(unconditional_likelihood_normalized, cond)


class StubNative(NativeBackend):
    """A native backend with a character tokenizer whose prompts score by a table."""

    def __init__(self, scores: dict[str, float]) -> None:
        super().__init__()
        self.scores = scores
        self.payloads: list[dict[str, Any]] = []

    def _generate(self, payload: dict[str, Any]) -> Any:
        self.payloads.append(payload)
        rows = payload["input_ids"]
        if not isinstance(rows[0], list):
            return {"text": "", "meta_info": {"prompt_tokens": len(rows), "cached_tokens": 0}}
        starts = payload["logprob_start_len"]
        out = []
        for row, start in zip(rows, starts, strict=True):
            text = "".join(chr(t) for t in row)
            lp = next((v for k, v in self.scores.items() if text.endswith(k)), -5.0)
            lps = [(None if i == 0 else lp, t, chr(t)) for i, t in enumerate(row)][start:]
            meta = {"input_token_logprobs": lps, "prompt_tokens": len(row), "cached_tokens": start}
            out.append({"text": "", "meta_info": meta})
        return out

    def _generate_stream(self, payload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from ()

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        # "ab" merges into one token, so a choice starting with "b" after "a" heals the boundary
        return [[ord(c) for c in t.replace("ab", "\x01")] for t in texts]

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return "".join(m["content"] for m in messages)

    def _auto_prefix(self) -> str:
        return ""

    def flush_cache(self) -> bool:
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {}


def select_req(
    text: str, choices: tuple[str, ...], method: Any = token_length_normalized
) -> SelectRequest:
    return SelectRequest(Context(text), choices, 0.0, method)


def test_native_select_scores_exactly_each_choice_tokens() -> None:
    stub = StubNative({"xa b": -0.5, "xa c": -1.0})
    decision = stub.select(select_req("xa ", ("b", "c")))
    assert decision.decision == "b"
    warm, score = stub.payloads
    assert warm == {
        "input_ids": [ord("x"), ord("a"), ord(" ")],
        "sampling_params": {"max_new_tokens": 0},
    }
    assert score["logprob_start_len"] == [3, 3] and score["return_logprob"] is True
    assert decision.meta_info["input_token_logprobs"] == [
        [(-0.5, ord("b"), "b")],
        [(-1.0, ord("c"), "c")],
    ]


def test_native_select_heals_a_merged_boundary_token() -> None:
    stub = StubNative({})
    stub.select(select_req("xa", ("b", "c")))
    score = stub.payloads[1]
    assert score["input_ids"] == [[ord("x"), 1], [ord("x"), ord("a"), ord("c")]]
    assert score["logprob_start_len"] == [1, 2]  # "ab" replaced the prompt's last token


def test_native_select_unconditional_and_errors() -> None:
    stub = StubNative({})
    stub.select(select_req("q ", ("yes", "no"), unconditional_likelihood_normalized))
    alone = stub.payloads[2]
    assert alone["input_ids"] == [[ord(c) for c in "yes"], [ord(c) for c in "no"]]
    assert alone["logprob_start_len"] == [0, 0]
    with pytest.raises(ValueError, match="temperature must be 0"):
        stub.select(SelectRequest(Context("q"), ("a",), 0.5, token_length_normalized))


def test_openai_echo_logprobs_cover_the_choice_tokens() -> None:
    lp = {
        "tokens": ["The", " sky", " is", " blue", "!"],
        "token_logprobs": [None, -1.0, -0.5, -0.2, -3.0],
        "text_offset": [0, 3, 7, 10, 15],
    }
    assert _choice_logprobs(lp, start=10, end=15) == [(-0.2, -1, " blue")]
    assert _choice_logprobs(lp, start=9, end=15) == [(-0.5, -1, " is"), (-0.2, -1, " blue")]
