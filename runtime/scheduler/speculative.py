"""Speculative decoding on the scheduler's side: how many drafts each running request gets, their
KV slots, and after the verify step the accepted tokens' bookkeeping (rejected slots freed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import build_decode_batch
from weft.runtime.scheduler.finish import check_finish
from weft.runtime.scheduler.ngram import NgramDrafter
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.spec_costs import StepCosts

# draft-length policy (see DraftPolicy)
ACCEPT_EMA = 0.5  # weight of the newest step in a request's acceptance average
PROBE_BELOW = 0.15  # a request accepting fewer than this share of its drafts gets one, a probe

# the draft model's proposals: (requests, k) -> k tokens each, their draft distributions
ProposeFn = Callable[[list[Req], int], tuple[list[list[int]], list[Any]]]


@dataclass
class SpecCounts:
    """A request's speculation so far (reported in meta_info)."""

    verify_steps: int = 0  # forwards that verified drafts for it
    drafted: int = 0
    accepted: int = 0
    acceptance: float = 1.0  # moving average of accepted / drafted per step

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            share = accepted / drafted
            self.acceptance = ACCEPT_EMA * share + (1 - ACCEPT_EMA) * self.acceptance


class DraftPolicy:
    """Drafts per request, per step.

    A request gets up to k drafts (`speculative_num_draft_tokens` - 1), never more than it may
    still generate after the step's own token. A request whose drafts are mostly rejected (its
    moving acceptance below PROBE_BELOW) drafts one token only, a probe that costs one more row
    of the verify forward and lets its average recover when the text turns repetitive again.
    A constrained request's drafts are cut at the first token its grammar refuses (the target,
    masked, would reject it); tokens the grammar forces are appended without drafting at all
    (jump-forward: finish.jump_forward).
    """

    def __init__(self, k: int) -> None:
        self.k = k

    def drafts_for(self, req: Req, counts: SpecCounts) -> int:
        room = req.remaining_new_tokens - 1
        want = 1 if counts.acceptance < PROBE_BELOW else self.k
        return max(min(want, room), 0)


class Speculator:
    """Builds the decode batch with drafts (the verify step) and settles it afterwards.

    The verify step runs each request's own new tokens (its last sampled one, or more after a
    grammar's jump-forward) followed by its drafts, in one EXTEND forward; the model samples at
    the last own token and at every draft. Slots for all of them are allocated up front; the
    slots past the accepted tokens are freed once the step is processed, so the conservation
    check holds and the radix tree only ever gets accepted tokens.
    """

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        stats: dict[str, int],
        propose: ProposeFn | None = None,
        graph_rows: int = 0,
    ) -> None:
        self.config = config
        self.cache = cache
        self.graph_rows = graph_rows  # the most tokens a verify step replays a graph with
        self.costs = StepCosts(stats)
        self.policy = DraftPolicy(config.speculative_num_draft_tokens - 1)
        self.ngram = config.speculative_algorithm == "ngram"
        self.propose_fn = None if self.ngram else propose
        self._verify_next: bool | None = None  # the choice for the next decode step, once made
        self._draft_s = 0.0  # the last build's time in the draft model (see take_draft_s)

    def verifies_next(self, batch_size: int) -> bool:
        """Whether the next decode step verifies drafts (StepCosts), chosen once per step: the
        scheduler asks before launching a decode behind one in flight (overlap), which a verify
        step may not follow, and `build` takes the same answer."""
        if self._verify_next is None:
            self._verify_next = self.costs.speculate(batch_size)
        return self._verify_next

    def build(self, running: list[Req]) -> Batch:
        """The decode batch of `running` (already retracted to fit one token each) with drafts
        where their slots fit; without any draft, the plain decode batch. Drafts need every
        request's last token on the host: no step may be in flight for them."""
        verify, self._verify_next = self.verifies_next(len(running)), None
        if not verify:
            return build_decode_batch(running, self.cache)
        assert not any(r.ahead for r in running), "a verify step built behind one in flight"
        want = self._within_graphs(running, [self._draft_len(r) for r in running])
        want = self._fit(running, want)
        if not any(want):
            return build_decode_batch(running, self.cache)
        own = [r.extend_len for r in running]
        for req, m, d in zip(running, own, want, strict=True):
            assert self.cache.alloc(req, m + d), "draft slots failed after they were checked"
        started = time.perf_counter()
        drafts = self._drafts(running, want)
        self._draft_s = time.perf_counter() - started
        for req, m, d, got in zip(running, own, want, drafts, strict=True):
            if len(got) < d:  # a grammar cut the draft model's chain: its slots' pages go back
                free_tail(self.cache, req, req.kv_len + m + len(got), req.kv_len + m + d)
        lens = [m + len(d) for m, d in zip(own, drafts, strict=True)]
        return Batch(ForwardMode.EXTEND, list(running), lens, drafts=drafts)

    def take_draft_s(self) -> float:
        """The seconds the last build spent drafting (0 after it was taken, or for a plain
        build): the verify step's own time, which StepClock must not charge to the step launched
        before it. The draft model's proposals wait for the device; without this, the plain
        decode step before a verify step would be timed with the drafts, and StepCosts would
        favour speculation."""
        seconds, self._draft_s = self._draft_s, 0.0
        return seconds

    def _draft_len(self, req: Req) -> int:
        counts = spec_counts(req)
        d = self.policy.drafts_for(req, counts)
        if self.propose_fn is not None:  # the draft model runs all k ahead, or none
            return self.policy.k if req.remaining_new_tokens - 1 >= self.policy.k else 0
        if d and self.ngram:
            drafter = req.ngram
            if drafter is None:
                drafter = req.ngram = NgramDrafter(
                    self.config.speculative_ngram_min_match_window_size,
                    self.config.speculative_ngram_max_match_window_size,
                )
            drafter.sync(req)
            req.pending_draft = grammar_prefix(req, drafter.propose(d))
            return len(req.pending_draft)
        return d

    def _within_graphs(self, running: list[Req], want: list[int]) -> list[int]:
        """The drafts cut as evenly as they go (the oldest requests keep one more) so that the
        verify step's tokens fit the largest decode graph, which then replays them as decode
        rows. A bigger verify step runs as one eager extend: at batch 64 (320 tokens) that took
        18-41 ms against a 2.5 ms plain step on the H100 (`benchmarks/spec_replay.py replay`).
        Where not even the requests' own tokens fit, the drafts stay as they are. (Shares that
        differ by at most one keep the draft model within each request's slots: it runs the
        largest share k ahead for all, over positions up to seq_len + k - 2.)"""
        room = self.graph_rows - sum(r.extend_len for r in running)
        if room <= 0 or sum(want) <= room:
            return want
        cap = max(want)
        while sum(min(w, cap) for w in want) > room:
            cap -= 1
        cut = [min(w, cap) for w in want]
        left = room - sum(cut)
        for i in sorted(range(len(running)), key=lambda i: running[i].arrival):
            if left == 0:
                break
            if want[i] > cut[i]:
                cut[i] += 1
                left -= 1
        return cut

    def _fit(self, running: list[Req], want: list[int]) -> list[int]:
        """Drop drafts, newest requests first, until every request's slots fit."""
        cache = self.cache
        order = sorted(range(len(running)), key=lambda i: running[i].arrival, reverse=True)
        want = list(want)

        def need() -> int:
            pairs = zip(running, want, strict=True)
            pages = sum(cache.pages_needed(r, r.extend_len + d) for r, d in pairs)
            return pages * cache.page_size

        for i in order:  # (a hybrid sliding-window pool: its SWA pages too)
            if need() <= cache.available_tokens and cache.swa_fits(running, want):
                break
            want[i] = 0
            if self.ngram:
                running[i].pending_draft = []
        return want

    def _drafts(self, running: list[Req], want: list[int]) -> list[list[int]]:
        if self.ngram:
            drafts = [r.pending_draft[:w] for r, w in zip(running, want, strict=True)]
            for r in running:
                r.pending_draft = []
            return drafts
        assert self.propose_fn is not None, "speculative_algorithm='draft' without a draft model"
        drafting = [r for r, d in zip(running, want, strict=True) if d]
        tokens, probs = self.propose_fn(drafting, max(want))  # (k, or fewer within graphs)
        got = {id(r): (t, p) for r, t, p in zip(drafting, tokens, probs, strict=True)}
        drafts = []
        for req, w in zip(running, want, strict=True):  # (each cut to its share)
            t, p = got.get(id(req), ([], None))
            req.draft_probs = None if p is None else p[:w]
            drafts.append(grammar_prefix(req, t[:w]))
        return drafts


def grammar_prefix(req: Req, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the request's grammar refuses (all without a grammar);
    the matcher is left as it was."""
    grammar = req.grammar
    if grammar is None or not drafts:
        return drafts
    n = 0
    for token in drafts:
        if not grammar.accept_token(token):
            break
        n += 1
    grammar.rollback(n)
    return drafts[:n]


def append_verified(req: Req, tokens: list[int], eos_ids: frozenset[int]) -> int:
    """Append a verify step's tokens to `req` one by one, each checked as a sampled token is,
    stopping at the first that finishes it; returns how many were appended."""
    for n, token in enumerate(tokens, 1):
        req.output_ids.append(token)
        req.finish = check_finish(req, token, eos_ids)
        if req.finish is not None:
            return n
    return len(tokens)


def settle_verify(
    req: Req, cache: KVCacheManager, ran_to: int, drafted: int, accepted: int
) -> None:
    """After a verify step's tokens were appended to `req` (append_verified): its KV holds the
    accepted tokens only; the pages of the rejected drafts' slots go back.

    `ran_to`: its kv_len after the step's launch (own tokens + drafts)."""
    new_kv = min(ran_to - drafted + accepted, req.seq_len - 1)
    req.kv_len = new_kv
    req.draft_len = min(req.draft_len, new_kv)
    free_tail(cache, req, new_kv, ran_to)
    spec_counts(req).record(drafted, accepted)
    req.draft_probs = None


def free_tail(cache: KVCacheManager, req: Req, used_to: int, allocated_to: int) -> None:
    """Give back the pages of the request's slots at positions [used_to, allocated_to) that lie
    wholly past `used_to`'s page (the partial page stays the request's, as alloc expects)."""
    p = cache.page_size
    keep = -(-used_to // p) * p
    if allocated_to > keep:
        assert req.row is not None
        cache.allocator.free(cache.table.cpu[req.row, keep:allocated_to].clone())


def spec_counts(req: Req) -> SpecCounts:
    if req.spec is None:
        req.spec = SpecCounts()
    assert isinstance(req.spec, SpecCounts)
    return req.spec
