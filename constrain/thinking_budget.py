"""A reasoning-token budget as a grammar matcher: reasoning runs freely (or under the request's
own matcher) until `budget` tokens of it were written, then the end marker is forced token by
token, as SGLang's strict thinking and llama.cpp's reasoning budget do.

The budget arms at the start of the output where the output starts inside the reasoning
(`starts_inside`, DeepSeek-R1), or once the output opens with the start marker's tokens (Qwen3:
an output that does not open with them has no reasoning, and no budget applies). Reasoning tokens
are counted after the start marker; the model's own end marker disarms it. Forced tokens are the
only ones the mask allows, so jump-forward and speculative drafts see them as any grammar's.

Without an inner matcher every token the model has is allowed outside the forced stretch, and
stop ids are left to the request's own rules (ignore_eos, min_new_tokens), as for an
unconstrained request: this matcher never terminates. With one (the chat route's constraint after
the reasoning), the inner matcher sees every token too; a forced token its grammar refuses
fails the request with a message (a constraint that applies from the start of the output).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from weft.constrain.base import GrammarMatcher
from weft.constrain.vocab import TokenSpace


@dataclass(frozen=True)
class BudgetState:
    """Where the output stands: `armed` (counting reasoning tokens), `count` of them, `opened`
    start-marker tokens matched so far (Qwen3, before arming), `ended` (no budget any more),
    `matched` end-marker tokens at the tail (a partial end marker, written or forced)."""

    armed: bool
    count: int = 0
    opened: int = 0
    ended: bool = False
    matched: int = 0


class ThinkingBudget(GrammarMatcher):
    """At most `budget` reasoning tokens, then `end_ids` forced; `inner`: the request's matcher."""

    def __init__(
        self,
        space: TokenSpace,
        inner: GrammarMatcher | None,
        budget: int,
        start_ids: Sequence[int],
        end_ids: Sequence[int],
        starts_inside: bool,
    ) -> None:
        if budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {budget}")
        if not end_ids or (not starts_inside and not start_ids):
            raise ValueError("the reasoning markers must have tokens")
        super().__init__(space)
        self.inner = inner
        self.budget = budget
        self.start_ids = tuple(start_ids)
        self.end_ids = tuple(end_ids)
        self.starts_inside = starts_inside
        self._states = [BudgetState(armed=starts_inside)]  # one per accepted token, plus the start

    ##### The budget #####

    def forced_next(self) -> int | None:
        """The end-marker token the budget forces next, or None."""
        s = self._states[-1]
        if s.ended or not s.armed or s.count < self.budget:
            return None
        return self.end_ids[s.matched]

    def _advance(self, s: BudgetState, token: int) -> BudgetState:
        if s.ended:
            return s
        if not s.armed:
            if s.opened < len(self.start_ids) and token == self.start_ids[s.opened]:
                opened = s.opened + 1
                return replace(s, opened=opened, armed=opened == len(self.start_ids))
            return replace(s, ended=True)  # no start marker: no reasoning, no budget
        matched = s.matched + 1 if token == self.end_ids[s.matched] else 0
        if matched == 0 and token == self.end_ids[0]:
            matched = 1
        if matched == len(self.end_ids):
            return replace(s, ended=True, matched=matched)
        counted = s.count + 1 if s.count < self.budget else s.count
        return replace(s, count=counted, matched=matched)

    ##### GrammarMatcher #####

    def _fill(self, bitmask: torch.Tensor, row: int, bind: bool) -> None:
        forced = self.forced_next()
        if self.inner is not None:
            self.inner.fill_bitmask(bitmask, row, bind)  # (also waits for a prefetched row)
            if forced is None:
                return
            ptr = self._row_ptr(bitmask, row)
            word = ctypes.c_int32.from_address(ptr + 4 * (forced // 32))
            if not (word.value >> (forced % 32)) & 1:
                raise ValueError(
                    "the request's constraint does not allow the reasoning end marker where "
                    "thinking_budget ends the reasoning (the constraint must start after the "
                    "reasoning: chat completions with --reasoning-parser)"
                )
        ptr = self._row_ptr(bitmask, row)
        space = self._space
        if forced is not None:
            ctypes.memset(ptr, 0, 4 * space.words)
            word = ctypes.c_int32.from_address(ptr + 4 * (forced // 32))
            word.value |= 1 << (forced % 32)
            return
        ctypes.memset(ptr, 0xFF, 4 * space.words)  # everything the model has, as unconstrained
        space.mask_padded(ptr)

    def accept_token(self, token: int) -> bool:
        if self._failure is not None:
            return False
        forced = self.forced_next()
        if forced is not None and token != forced:
            return False
        if self.inner is not None:
            if not self.inner.accept_token(token):
                return False
        elif not 0 <= token < self._space.tokenizer_size:
            return False
        self._states.append(self._advance(self._states[-1], token))
        return True

    def rollback(self, k: int) -> None:
        assert 0 <= k < len(self._states)
        if self.inner is not None:
            self.inner.rollback(k)
        del self._states[len(self._states) - k :]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated() if self.inner is not None else False

    def forced_tokens(self) -> list[int]:
        """The rest of the end marker while the budget forces it, then the inner's forced
        tokens (computed from the state after the marker, so only up to the marker here)."""
        if self.error() is not None or self.is_terminated():
            return []
        forced = self.forced_next()
        if forced is not None:
            return list(self.end_ids[self._states[-1].matched :])
        return self.inner.forced_tokens() if self.inner is not None else []

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()

    def error(self) -> str | None:
        if self._failure is not None:
            return self._failure
        return self.inner.error() if self.inner is not None else None

    def _clone(self) -> GrammarMatcher:
        inner = self.inner.copy() if self.inner is not None else None
        clone = ThinkingBudget(self._space, inner, self.budget, self.start_ids, self.end_ids,
                               self.starts_inside)  # fmt: skip
        clone._states = list(self._states)
        return clone

    # the hooks below are unused: the public methods above are overridden whole
    def _fill_content(self, row_ptr: int) -> None:
        raise NotImplementedError

    def _can_end(self) -> bool:
        raise NotImplementedError

    def _accept_content(self, token: int) -> bool:
        raise NotImplementedError

    def _rollback_content(self, k: int) -> None:
        raise NotImplementedError

    def _forced_content(self) -> list[int]:
        raise NotImplementedError
