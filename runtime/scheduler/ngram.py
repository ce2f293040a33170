"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of a
request's longest matching suffix, from its own prompt and output."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

GROW = 1024  # token buffer growth step


class NgramDrafter:
    """One per request: its tokens in a growing numpy buffer (appended as they come, never
    rebuilt), searched for the suffix each step.

    The match: the longest n in [min_n, max_n] such that the last n tokens occur earlier, at the
    latest such place; the draft is up to k tokens that followed it there. A search costs a few
    vectorized passes over the tokens (one per matched length), microseconds for thousands.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram windows need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._buf = np.empty(GROW, dtype=np.int64)
        self._len = 0

    def sync(self, req: Req) -> None:
        """Make the buffer hold the request's input + output ids (only the new tail is copied)."""
        n = req.seq_len
        if n < self._len:
            self._len = n
        if n > self._len:
            if n > self._buf.shape[0]:
                grown = np.empty(n + GROW, dtype=np.int64)
                grown[: self._len] = self._buf[: self._len]
                self._buf = grown
            self._buf[self._len : n] = req.tokens(self._len, n)
            self._len = n

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens to follow the buffer's tokens ([] when no suffix matches)."""
        t = self._buf[: self._len]
        n_tok = t.shape[0]
        if k <= 0 or n_tok < self.min_n + 1:
            return []
        # candidates: end positions p (< n_tok - 1) whose token equals the last one
        cand = np.flatnonzero(t[:-1] == t[-1])
        best: np.ndarray = cand
        length = 1
        # extend the match backwards one token at a time while candidates survive
        while cand.size and length < self.max_n:
            back = cand - length
            ok = back >= 0
            cand = cand[ok]
            back = back[ok]
            cand = cand[t[back] == t[n_tok - 1 - length]]
            if cand.size:
                best, length = cand, length + 1
        if length < self.min_n or not best.size:
            return []
        start = int(best[-1]) + 1  # the latest occurrence of the longest match
        return t[start : start + k].tolist()
