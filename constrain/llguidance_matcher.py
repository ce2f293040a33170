"""A request's llguidance matcher, and its mask prefetch: after creation and each accepted token, the
state's mask is computed on a background thread (llguidance_prefetch; the library drops the GIL)
and written into the row of the last `fill_bitmask(..., bind=True)` (the request's slot) until
`release()`: a fill of that row only waits for it (another row: a copy). Masks are the library's
own either way."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from weft.constrain.base import GrammarMatcher
from weft.constrain.errors import GrammarError
from weft.constrain.llguidance_prefetch import BoundRow, Job, MaskWorker
from weft.constrain.vocab import TokenSpace


class LLGuidanceMatcher(GrammarMatcher):
    """A request's llguidance matcher; with a `worker`, each accepted token starts the next mask
    there (`prefetch_forced`: also in a state with forced tokens, for callers that sample them
    through masks rather than jump forward, whose accept would wait for the mask).

    NOTE: while a prefetch runs, the library holds the matcher, so every hook that touches
    `self._m` waits for it first (`_join`). Masks are identical with and without prefetch.
    """

    def __init__(
        self,
        space: TokenSpace,
        matcher: Any,
        worker: MaskWorker | None = None,
        prefetch_forced: bool = False,
    ) -> None:
        super().__init__(space)
        self._m = matcher
        self._worker, self._prefetch_forced = worker, prefetch_forced
        self._row = BoundRow(space.words) if worker is not None else None
        self._in_place = False  # the fill in progress delivered the prefetched mask
        self._job: Job | None = None  # in flight, or done but not joined
        self._ready = False  # the buffer holds the mask of the current state, finished (a row)
        self._filled = False  # a fill has delivered the current state's mask
        self._forced: list[int] | None = None  # forced tokens of the current state, if known
        self._prefetch_if_unforced()  # the first mask too: a prefill runs before its fill

    def _fill(self, bitmask: torch.Tensor, row: int, bind: bool) -> None:
        self._join()  # NOTE: no job may write a row while this thread writes one
        row_ = self._row
        fresh = self._ready and not self._filled and self._failure is None
        if bind and fresh and not self._stops and row_ is not None:
            if row_.holds(bitmask, row):  # the common case: the prefetch is already in the row
                self._filled = self._in_place = True  # NOTE: what the full path below ends with
                return
        self._in_place = False
        super()._fill(bitmask, row, bind)
        if self._row is not None:  # bound: the next prefetch also writes its mask there
            self._row.bind(bitmask if bind else None, row, holds=self._in_place)

    def release(self) -> None:
        if self._row is not None:
            self._row.release()

    def _library_error(self) -> str | None:
        if (self._job is not None or self._ready) and not self._filled:
            # NOTE: a prefetch starts only from a state without error; an error it met (a fuel
            # limit) shows once a fill delivered its mask, as when the fill computes it itself.
            return None
        return self._message() if self._m.is_error() else None

    def _fill_final(self, row_ptr: int) -> bool:
        """A prefetched mask is a finished row (the worker cleared non-content bits and added
        the stops where the grammar may end), already in the row if it is the bound one, else
        one copy; no call into the library here."""
        self._join()
        if not self._ready:
            return False
        assert self._row is not None
        if self._row.published != row_ptr:
            ctypes.memmove(row_ptr, ctypes.addressof(self._row.buffer), self._space.words * 4)
        self._filled = self._in_place = True
        return True

    def _fill_content(self, row_ptr: int) -> None:
        self._join()
        self._m.unsafe_compute_mask_ptr(row_ptr, self._space.words * 4)
        self._filled = True

    def _can_end(self) -> bool:
        self._join()
        return bool(self._m.is_accepting())

    def _accept_content(self, token: int) -> bool:
        self._join()
        # NOTE: consume_token on a forbidden token poisons the matcher; validate first.
        if self._m.validate_tokens([token]) != 1:
            return False
        if not self._m.consume_token(token):  # e.g. a lexer limit met on the way
            raise GrammarError(self._message())
        self._ready = self._filled = False
        self._forced = None
        self._prefetch_if_unforced()
        return True

    def _rollback_content(self, k: int) -> None:
        self._join()
        if not self._m.rollback(k):
            raise GrammarError(f"rollback({k}) failed: {self._message()}")
        self._ready = self._filled = False
        self._forced = None

    def _forced_content(self) -> list[int]:
        if self._forced is None:
            self._join()
            self._forced = list(self._m.compute_ff_tokens())
        return list(self._forced)

    def _clone(self) -> GrammarMatcher:
        self._join()
        return LLGuidanceMatcher(
            self._space, self._m.deep_copy(), self._worker, self._prefetch_forced
        )

    ##### Internal Helper Functions #####

    def _message(self) -> str:
        """The library's error, without its markup."""
        return " ".join(str(self._m.get_error()).replace("<non-verbose/>", "").split())

    def _prefetch_if_unforced(self) -> None:
        """Start computing this state's mask, unless it has an error, or forced tokens without
        `prefetch_forced` (jump-forward will append them: no mask is filled there)."""
        if self._worker is not None and not self._m.is_error():
            self._forced = list(self._m.compute_ff_tokens())
            if not self._forced or self._prefetch_forced:
                self._start_prefetch()

    def _start_prefetch(self) -> None:
        assert self._row is not None and self._worker is not None
        self._row.published = 0  # NOTE: no job in flight: the last one was joined
        self._job = self._worker.submit(self._m, self._row.buffer, self._finish)

    def _finish(self, address: int) -> None:
        """On the worker thread, right after the mask: make it the final row (see _fill_final;
        NOTE: the library's state is the one the mask was computed for, as nothing touches
        the matcher while its job runs), and write it into the bound row."""
        space = self._space
        space.mask_non_content(address)
        if self._m.is_accepting():
            space.allow_stops(address)
        assert self._row is not None
        self._row.publish()

    def _join(self) -> None:
        """Wait for the prefetch in flight, if any; the buffer then holds the current state's mask."""
        job = self._job
        if job is None:
            return
        self._job = None
        job.wait()  # released by the worker
        self._ready = True
