"""The thinking-budget matcher on a small token space: it arms where the reasoning starts,
counts reasoning tokens, forces a (multi-token) end marker exactly once the budget is spent,
lets the model end early, rolls back and copies; the mask allows everything else (padded ids
excepted) and the budget never ends a request; an inner matcher is consulted on every token.
And the scheduler refuses a budget where no reasoning parser names the markers."""

from __future__ import annotations

from pathlib import Path

import pytest

from weft.constrain import allocate_bitmask
from weft.constrain.base import GrammarMatcher
from weft.constrain.thinking_budget import ThinkingBudget
from weft.constrain.vocab import TokenSpace
from weft.runtime.config import EngineConfig
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

SPACE = TokenSpace(72, 70, [0], [5, 6, 7], "tok")  # ids 70, 71: padded logit rows
START, END = (5,), (6, 7)  # a one-token start marker, a two-token end marker


def allowed(m: GrammarMatcher) -> set[int]:
    mask = allocate_bitmask(1, SPACE.vocab_size)
    m.fill_bitmask(mask, 0)
    words = mask[0].tolist()
    return {i for i in range(SPACE.vocab_size) if (words[i // 32] >> (i % 32)) & 1}


def feed(m: GrammarMatcher, tokens: list[int]) -> None:
    for t in tokens:
        assert m.accept_token(t), t


def test_inside_from_the_start_forces_the_end_marker_after_the_budget() -> None:
    m = ThinkingBudget(SPACE, None, 3, START, END, starts_inside=True)
    assert allowed(m) == set(range(70)) and m.forced_tokens() == []
    feed(m, [10, 11, 12])
    assert allowed(m) == {6} and m.forced_tokens() == [6, 7]
    assert not m.accept_token(10) and not m.accept_token(0)  # nothing else, not even a stop
    feed(m, [6])
    assert allowed(m) == {7} and m.forced_tokens() == [7]
    feed(m, [7])
    assert allowed(m) == set(range(70)) and m.forced_tokens() == []
    feed(m, [10] * 8 + [0, 6, 7])  # the answer is free, a stop id never ends the matcher
    assert not m.is_terminated() and m.error() is None


def test_a_start_marker_arms_it_and_an_output_without_one_has_no_budget() -> None:
    m = ThinkingBudget(SPACE, None, 1, START, END, starts_inside=False)
    feed(m, [5])  # <think>: not counted
    assert m.forced_tokens() == []
    feed(m, [10])
    assert m.forced_tokens() == [6, 7]
    plain = ThinkingBudget(SPACE, None, 0, START, END, starts_inside=False)
    feed(plain, [10])  # no <think> first: all answer
    assert plain.forced_tokens() == [] and allowed(plain) == set(range(70))


def test_budget_zero_and_the_model_ending_on_its_own() -> None:
    m = ThinkingBudget(SPACE, None, 0, START, END, starts_inside=False)
    feed(m, [5])
    assert m.forced_tokens() == [6, 7]
    early = ThinkingBudget(SPACE, None, 5, START, END, starts_inside=True)
    feed(early, [10, 6, 11, 6, 7])  # a partial marker interrupted, then the whole one
    feed(early, [12] * 10)
    assert early.forced_tokens() == []


def test_rollback_and_copy() -> None:
    m = ThinkingBudget(SPACE, None, 2, START, END, starts_inside=True)
    feed(m, [10, 11, 6])
    twin = m.copy()
    m.rollback(2)  # back to one reasoning token
    assert m.forced_tokens() == [] and allowed(m) == set(range(70))
    feed(m, [12])
    assert m.forced_tokens() == [6, 7]
    assert twin.forced_tokens() == [7]  # the copy kept its own state


class _OnlyEven(GrammarMatcher):
    """An inner grammar: even ids only; ends after a stop."""

    def __init__(self) -> None:
        super().__init__(SPACE.allowing([6]))
        self.seen: list[int] = []

    def _fill_content(self, row_ptr: int) -> None:
        import ctypes

        ctypes.memset(row_ptr, 0, 4 * SPACE.words)
        for i in range(0, 70, 2):
            cell = ctypes.c_int32.from_address(row_ptr + 4 * (i // 32))
            cell.value |= 1 << (i % 32)

    def _can_end(self) -> bool:
        return True

    def _accept_content(self, token: int) -> bool:
        if token % 2:
            return False
        self.seen.append(token)
        return True

    def _rollback_content(self, k: int) -> None:
        del self.seen[len(self.seen) - k :]

    def _forced_content(self) -> list[int]:
        return []

    def _clone(self) -> GrammarMatcher:
        clone = _OnlyEven()
        clone.seen = list(self.seen)
        return clone


def test_an_inner_matcher_sees_every_token_and_refusing_the_marker_fails_the_request() -> None:
    inner = _OnlyEven()
    m = ThinkingBudget(SPACE, inner, 1, START, (6,), starts_inside=True)
    assert allowed(m) == set(range(0, 70, 2))  # the inner mask: 6 its structure token, 0 a stop
    assert not m.accept_token(11)
    feed(m, [10])
    assert allowed(m) == {6} and m.forced_tokens() == [6]
    feed(m, [6, 12])
    assert inner.seen == [10, 6, 12]
    m.rollback(2)
    assert inner.seen == [10] and m.forced_tokens() == [6]
    feed(m, [6, 0])
    assert m.is_terminated()
    refusing = ThinkingBudget(SPACE, _OnlyEven(), 0, START, (7,), starts_inside=True)
    assert allowed(refusing) == {0}  # the matcher failed: stops only, the request ends
    assert "does not allow the reasoning end marker" in (refusing.error() or "")


def test_bad_budgets_and_markers_are_value_errors() -> None:
    with pytest.raises(ValueError, match="thinking_budget"):
        ThinkingBudget(SPACE, None, -1, START, END, starts_inside=True)
    with pytest.raises(ValueError, match="markers"):
        ThinkingBudget(SPACE, None, 1, (), END, starts_inside=False)
    with pytest.raises(ValueError, match="thinking_budget must be at least 0"):
        SamplingParams(thinking_budget=-2)


def test_the_scheduler_refuses_a_budget_without_a_reasoning_parser(tiny_model_dir: Path) -> None:
    sched = Scheduler(EngineConfig(model=str(tiny_model_dir), cpu_threads=1), tiny_model_dir, None)
    params = SamplingParams(max_new_tokens=4, thinking_budget=2)
    refused = sched.intake.add_request(TokenizedGenerateReq("r", [10, 11, 12], params, 4))
    assert refused is not None and refused.finish is not None
    assert refused.finish.status == 400 and "--reasoning-parser" in refused.finish.message
