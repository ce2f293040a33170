"""Prefill admission: pick waiting requests for an extend batch within token, slot and memory budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler.admission import KVForecast
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req

LPM_MAX_WAITING = 128  # above this many waiting requests, LPM sorting costs more than it saves
IN_BATCH_PREFIX_TOKENS = 32  # uncached tokens two prompts must share for the later one to wait


def order_waiting(waiting: list[Req], policy: str, cache: KVCacheManager) -> list[Req]:
    """FCFS: arrival order. LPM: longest cached prefix first (ties by arrival)."""
    if policy == "lpm" and len(waiting) <= LPM_MAX_WAITING:
        return sorted(waiting, key=lambda r: (-cache.match_len(r), r.arrival))
    return sorted(waiting, key=lambda r: r.arrival)


class SharedPrefixGate:
    """In-batch prefix sharing: a prompt whose next uncached tokens are being prefilled by a request
    already admitted to this batch waits one step, then reuses that KV from the radix cache instead
    of computing it again (G requests sharing a long prefix cost one prefill of it, not G)."""

    def __init__(self) -> None:
        # (cached length, LoRA adapter) -> next tokens computed (adapters share no KV)
        self.keys: dict[tuple[int, str | None], set[tuple[int, ...]]] = {}

    def admitted(self, req: Req, start: int | None = None) -> None:
        """`req` computes its tokens from `start` on (default: its KV length, as it is admitted)
        in this batch or one in flight (a chunk may go on)."""
        start = req.kv_len if start is None else start
        if len(req.input_ids) - start >= IN_BATCH_PREFIX_TOKENS:
            window = tuple(req.input_ids[start : start + IN_BATCH_PREFIX_TOKENS])
            self.keys.setdefault((start, req.lora_path), set()).add(window)

    def should_wait(self, req: Req) -> bool:
        if req.row is not None:  # already holds KV (a chunked or resumed request)
            return False
        for (start, lora), windows in self.keys.items():
            if lora != req.lora_path:
                continue
            window = tuple(req.input_ids[start : start + IN_BATCH_PREFIX_TOKENS])
            if len(window) == IN_BATCH_PREFIX_TOKENS and window in windows:
                return True
        return False


@dataclass
class PrefillAdder:
    """Builds one extend batch. Requests are admitted whole or, when they exceed the chunk size or
    the remaining budget, as a first chunk; the chunked request continues in the next step."""

    cache: KVCacheManager
    token_budget: int  # max new tokens in this batch
    chunk_size: int  # 0: no chunking (a prompt over the budget then runs alone)
    max_new_reqs: int  # free running slots
    forecast: KVForecast  # the running requests' future KV use (those admitted here join it)
    idle: bool  # no request is running (then the first request is admitted whatever its size)
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    chunked: Req | None = None

    def add(self, req: Req) -> bool:
        """Try to admit `req` (or its next chunk). False: stop adding to this batch."""
        if (
            self.chunked is not None
            or len(self.reqs) >= self.max_new_reqs
            or self.token_budget <= 0
        ):
            return False
        fresh = req.row is None
        if fresh and not self.cache.admit(req):
            return False
        n = req.extend_len
        if self.chunk_size:
            take = min(n, self.token_budget, self.chunk_size)
        elif n <= self.token_budget or not self.reqs:
            take = n  # without chunking, a prompt over the budget runs alone
        else:
            return self._undo(req, fresh)
        # admit only if the whole rest of the prompt and the predicted peak of every request's
        # decodes fit, even when just a first chunk runs now: a chunk that can never be
        # followed would livelock
        need = self.cache.pages_needed(req, n) * self.cache.page_size
        alone = self.idle and not self.reqs  # fits by construction (boundary checks)
        if not alone and not self.forecast.fits(req, need):
            return self._undo(req, fresh)
        if not self.cache.alloc(req, take):  # (after `fits`, it cannot fail)
            return self._undo(req, fresh)
        if alone:
            self.forecast.add(req, need)
        self.reqs.append(req)
        self.extend_lens.append(take)
        self.token_budget -= take
        if take < n:
            self.chunked = req
        return True

    def _undo(self, req: Req, fresh: bool) -> bool:
        if fresh:
            self.cache.cache_req(req, release=True)
        return False

    def batch(self) -> Batch | None:
        if not self.reqs:
            return None
        return Batch(ForwardMode.EXTEND, self.reqs, self.extend_lens)
