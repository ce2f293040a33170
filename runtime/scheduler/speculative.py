"""Speculative decoding on the scheduler's side: how many drafts each running request gets, their
KV slots, and after the verify step the accepted tokens' bookkeeping (rejected slots freed)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import build_decode_batch
from weft.runtime.scheduler.finish import check_finish
from weft.runtime.scheduler.ngram import NgramDrafter
from weft.runtime.scheduler.request import Req

# draft-length policy (see DraftPolicy)
ACCEPT_EMA = 0.5  # weight of the newest step in a request's acceptance average
PROBE_BELOW = 0.15  # a request accepting fewer than this share of its drafts gets one, a probe
# whether to speculate at all (see StepCosts)
STEP_EMA = 0.2  # weight of the newest step in the tokens-per-step average
STEP_SAMPLES = 5  # step times kept per kind and batch-size class (see _typical)
REVISIT_EVERY = 32  # a batch-size class re-measures its less used kind of step this often ...
REVISIT_MAX = 256  # ... twice as rarely after each revisit that kept the choice, up to this
REVISIT_PLAIN_STEPS = 2  # plain steps in a row a revisit runs (the first is timed: see observe)

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


def size_class(batch_size: int) -> int:
    """Batch sizes measured together: powers of two (1, 2, 4, ...)."""
    return 1 << (batch_size - 1).bit_length()


@dataclass
class ClassCosts:
    """One batch-size class's recent step times (seconds per plain decode step and per verify
    step, the last STEP_SAMPLES of each) and the tokens each request got per verify step (a
    moving average)."""

    decode: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    verify: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    tokens_per_req: float | None = None
    since_revisit: int = 0
    revisit_every: int = REVISIT_EVERY
    plain_left: int = 0  # more plain steps the revisit under way runs
    better: bool | None = None  # whether verify steps paid at the last choice

    @property
    def decode_s(self) -> float | None:
        return _typical(self.decode)

    @property
    def verify_s(self) -> float | None:
        return _typical(self.verify)


class StepCosts:
    """Speculation pays when a verify step gives more tokens per second than a plain decode
    step: tokens_per_req / verify_s >= 1 / decode_s, both measured while serving, per batch-size
    class (the cost of verifying k more tokens per request grows with the batch as the step
    turns from reading weights to computing; acceptance depends on the text). A class first
    tries both kinds of step, then takes the faster, and runs the other kind once after
    REVISIT_EVERY choices so that a change (other text, longer contexts) is seen; each revisit
    that keeps the choice doubles the wait (up to REVISIT_MAX: a slower kind costs under 1% of
    the steps), a flip starts it again from REVISIT_EVERY.

    A plain step is timed only where a plain step follows it: a run of them overlaps each
    step's host work with the next one's device time, but the step before a verify step is
    waited for and its results processed before the drafts are built, a cost that belongs to
    switching kinds and made verify steps look better than they are (in an H100 replay at batch
    64, `benchmarks/spec_replay.py replay`, timed that way, they ran at every step at 0.4x of
    plain decoding). So a class measures plain steps, at first and on revisits,
    REVISIT_PLAIN_STEPS in a row.

    Probing costs what a verify step loses against plain steps, which at large batches is
    several plain steps (an H100 replay at batch 64: verify steps of 17 ms against plain ones
    of 2.6 ms, `benchmarks/spec_replay.py replay`). So a class not yet measured first takes the
    verdict of the nearest measured class, its verify step's extra time over a plain step
    scaled by the batch (the extra is compute, which grows with the tokens verified), and only
    probes where that says speculation may pay; otherwise it measures at its first revisit.
    And a class that chose plain steps waits (1 + the plain steps a verify step loses) times
    longer between revisits, so a revisit's cost stays a small share of the steps."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.stats = stats
        self.classes: dict[int, ClassCosts] = {}
        self._seen = (0, 0)  # verify steps and accepted drafts already counted

    def speculate(self, batch_size: int) -> bool:
        size = size_class(batch_size)
        c = self.classes.setdefault(size, ClassCosts())
        if c.plain_left > 0:
            c.plain_left -= 1
            return False
        if c.verify_s is None:
            better = self._estimate(size, c)
            if better is None or better:
                return True  # a probe: the class's own verify time
        elif c.decode_s is None:
            return False
        else:
            better = _pays(c.tokens_per_req, c.verify_s, c.decode_s)
        if c.better is not None and better != c.better:
            c.revisit_every = REVISIT_EVERY
        c.better = better
        c.since_revisit += 1
        if c.since_revisit < round(c.revisit_every * (1 if better else _revisit_cost(c))):
            return better
        c.since_revisit = 0
        c.revisit_every = min(2 * c.revisit_every, REVISIT_MAX)
        if better:  # a revisit of plain steps: a run of them
            c.plain_left = REVISIT_PLAIN_STEPS - 1
        return not better

    def observe(self, kind: str, batch_size: int, seconds: float, next_kind: str) -> None:
        """StepClock's listener: a decode or verify step took `seconds`, launch to launch, and
        a step of `next_kind` launched next (a plain step counts only before a plain step)."""
        if kind not in ("decode", "verify"):
            return
        c = self.classes.setdefault(size_class(batch_size), ClassCosts())
        if kind == "decode":
            if next_kind == "decode":
                c.decode.append(seconds)
            return
        c.verify.append(seconds)
        steps, accepted = self.stats["spec_verify_steps"], self.stats["spec_accepted_tokens"]
        d_steps, d_acc = steps - self._seen[0], accepted - self._seen[1]
        self._seen = (steps, accepted)
        if d_steps > 0:  # (the verify step's results are processed before the next launch)
            c.tokens_per_req = _ema(c.tokens_per_req, (d_acc + d_steps) / d_steps)

    def _estimate(self, size: int, c: ClassCosts) -> bool | None:
        """Whether verify steps would pay in class `size` (without its own verify time), by
        the nearest class that measured both kinds (the larger of two as near): its tokens per
        request, and its verify step's extra time over a plain step times size / its size, on
        this class's plain step time where it has one. None where no class measured both."""
        known = [(k, o) for k, o in self.classes.items() if o.verify_s and o.decode_s]
        if not known:
            return None
        k, o = min(known, key=lambda ko: (abs(ko[0].bit_length() - size.bit_length()), -ko[0]))
        assert o.verify_s is not None and o.decode_s is not None
        decode = c.decode_s if c.decode_s is not None else o.decode_s
        verify = decode + max(0.0, o.verify_s - o.decode_s) * size / k
        return _pays(o.tokens_per_req, verify, decode)


def _pays(tokens_per_req: float | None, verify_s: float, decode_s: float) -> bool:
    """A verify step's tokens per second at least a plain step's."""
    return (tokens_per_req or 1.0) / verify_s >= 1.0 / decode_s


def _revisit_cost(c: ClassCosts) -> float:
    """1 + the plain steps' worth of time a verify step loses against plain steps (1 where the
    class has not timed both kinds)."""
    if c.verify_s is None or c.decode_s is None:
        return 1.0
    return 1.0 + max(0.0, c.verify_s / c.decode_s - (c.tokens_per_req or 1.0))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else STEP_EMA * new + (1 - STEP_EMA) * old


def _typical(samples: deque[float]) -> float | None:
    """A kind's step time: the median of its recent samples, the smallest while there are
    fewer than 3 (a class's first step of a kind may carry one-time costs, and a moving
    average kept such an outlier for many revisits, each of which adds one sample)."""
    if not samples:
        return None
    return min(samples) if len(samples) < 3 else statistics.median(samples)


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
    ) -> None:
        self.config = config
        self.cache = cache
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
        want = [self._draft_len(r) for r in running]
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
            drafts = [list(r.pending_draft) for r in running]
            for r in running:
                r.pending_draft = []
            return drafts
        assert self.propose_fn is not None, "speculative_algorithm='draft' without a draft model"
        drafting = [r for r, d in zip(running, want, strict=True) if d]
        tokens, probs = self.propose_fn(drafting, self.policy.k)
        got = {id(r): (t, p) for r, t, p in zip(drafting, tokens, probs, strict=True)}
        drafts = []
        for req in running:
            t, p = got.get(id(req), ([], None))
            req.draft_probs = p
            drafts.append(grammar_prefix(req, t))
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
