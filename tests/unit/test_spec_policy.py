"""Speculative decoding's host-side parts: the n-gram drafter's matches, the draft-length policy,
the measured choice between verify and plain decode steps per batch-size class, and the step
clock that times them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_helpers import make_cache, make_req, prefill

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler import stats
from weft.runtime.scheduler.ngram import NgramDrafter
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.spec_costs import (
    REVISIT_EVERY,
    REVISIT_MAX,
    REVISIT_PLAIN_STEPS,
    StepCosts,
    size_class,
)
from weft.runtime.scheduler.speculative import DraftPolicy, SpecCounts, Speculator, free_tail


def drafter_for(tokens: list[int], lo: int = 1, hi: int = 4) -> NgramDrafter:
    d = NgramDrafter(lo, hi)
    d.sync(make_req("r", tokens))
    return d


def test_longest_then_latest_match() -> None:
    # suffix [2, 3]: matches at 1..2 (followed by 9) and at 5..6 (followed by 7); [1, 2, 3]
    # only at 0..2: the longest wins over the latest
    toks = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    assert drafter_for(toks).propose(3) == [9, 8, 2]
    # without the longer match the latest of the equal ones wins
    toks = [5, 2, 3, 9, 8, 2, 3, 7, 6, 2, 3]
    assert drafter_for(toks).propose(2) == [7, 6]


def test_no_match_and_window_bounds() -> None:
    assert drafter_for([1, 2, 3, 4]).propose(3) == []
    assert drafter_for([1, 2, 1, 3, 1], lo=2).propose(3) == []  # only 1-token matches
    assert drafter_for([1, 2, 1, 3, 1], lo=1).propose(3) == [3, 1]
    assert drafter_for([4, 4, 4]).propose(0) == []


def test_sync_appends_only_the_new_tail() -> None:
    req = make_req("r", [1, 2, 3, 1])
    d = NgramDrafter(1, 3)
    d.sync(req)
    assert d.propose(2) == [2, 3]
    req.output_ids += [2, 3, 5]
    d.sync(req)
    assert d.propose(5) == []  # the new last token, 5, never came before
    for n in range(3000):  # the buffer grows past its first size
        req.output_ids.append(n % 7)
    d.sync(req)
    full = req.fill_ids
    assert d.propose(3) == full[len(full) - 7 : len(full) - 4]  # one period back


def test_draft_policy_caps_and_probes() -> None:
    req = make_req("r", [1, 2, 3])
    req.max_new_tokens = 10
    policy = DraftPolicy(4)
    counts = SpecCounts()
    assert policy.drafts_for(req, counts) == 4
    req.output_ids = [0] * 8  # two tokens left: the step's own one and one draft
    assert policy.drafts_for(req, counts) == 1
    req.output_ids = []
    for _ in range(6):
        counts.record(4, 0)
    assert policy.drafts_for(req, counts) == 1  # a probe
    for _ in range(4):
        counts.record(1, 1)
    assert policy.drafts_for(req, counts) == 4


def probed(size: int, tokens_per_req: float, verify_s: float) -> StepCosts:
    """StepCosts after a first class's probe: a verify step of `size` requests that took
    verify_s and gave each tokens_per_req tokens (accepted drafts + its own)."""
    stats = {"spec_verify_steps": 0, "spec_accepted_tokens": 0}
    costs = StepCosts(stats)
    assert costs.speculate(size)  # nothing measured: a verify step first
    stats["spec_verify_steps"] += size
    stats["spec_accepted_tokens"] += round(size * (tokens_per_req - 1))
    costs.observe("verify", size, verify_s, "decode")
    return costs


def test_step_costs_choose_the_faster_kind_and_revisit() -> None:
    assert size_class(5) == 8 and size_class(1) == 1 and size_class(64) == 64
    costs = probed(8, 2, 0.015)  # first a verify step ...
    assert not costs.speculate(8)  # ... then plain ones, until one is timed
    costs.observe("decode", 8, 0.010, "decode")
    # 2 tokens / 15 ms beats 1 token / 10 ms: speculate, except one revisit (two plain steps)
    # after REVISIT_EVERY choices, then after twice as many, ... up to REVISIT_MAX
    assert REVISIT_PLAIN_STEPS == 2
    picks = [costs.speculate(8) for _ in range(REVISIT_EVERY * 7 + 4)]
    plain = [i + 1 for i, p in enumerate(picks) if not p]
    r = REVISIT_EVERY
    assert plain == [r, r + 1, 3 * r + 1, 3 * r + 2, 7 * r + 2, 7 * r + 3], plain
    c = costs.classes[8]
    c.since_revisit, c.revisit_every = 0, REVISIT_MAX
    picks = [costs.speculate(8) for _ in range(2 * REVISIT_MAX + 2)]
    assert picks.count(False) == 4
    # the verify step slows down (a bigger batch computing more): plain decode wins, and the
    # flip starts the revisits again from REVISIT_EVERY, times 1 + the plain steps a verify
    # step loses (30 ms for 2 tokens against 10 ms for 1: one step)
    for _ in range(20):
        costs.observe("verify", 8, 0.030, "verify")
    picks = [costs.speculate(8) for _ in range(2 * REVISIT_EVERY)]
    assert picks.count(True) == 1 and picks[-1], picks
    # a class of 1 estimates from class 8: 10 ms + 20 ms / 8 for 2 tokens pays: it probes
    assert costs.speculate(1)


def test_an_unmeasured_class_takes_the_nearest_measured_verdict() -> None:
    """Class 64 measured verify steps of 17.5 ms for 2.5 tokens against plain steps of 2.5 ms
    (a verify step loses 7 - 2.5 = 4.5 plain steps). Class 32 estimates 2.5 + 15 / 2 = 10 ms:
    plain, without a probe, until its first revisit; class 4 estimates 2.5 + 15 / 16 ms: it
    probes. Class 64 revisits after REVISIT_EVERY * 5.5 choices."""
    costs = probed(64, 2.5, 0.0175)
    assert not costs.speculate(64) and not costs.speculate(64)
    costs.observe("decode", 64, 0.0025, "decode")
    picks = [costs.speculate(32) for _ in range(REVISIT_EVERY)]
    assert picks.count(True) == 1 and picks[-1], picks  # only its first revisit probes
    assert costs.speculate(3)
    picks = [costs.speculate(64) for _ in range(int(REVISIT_EVERY * 5.5))]
    assert picks.count(True) == 1 and picks[-1], picks
    # nothing measured anywhere: a new class probes first, as the very first class did
    assert StepCosts({"spec_verify_steps": 0, "spec_accepted_tokens": 0}).speculate(16)


def test_step_clock_charges_a_verify_steps_drafting_to_it_not_to_the_step_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft model's proposals run while the verify step is built, after the plain step
    before it launched: timed launch to launch, they would make that plain step look slow."""
    now = [100.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: now[0])
    seen: list[tuple[str, int, float, str]] = []
    clock = stats.StepClock()
    clock.listener = lambda *told: seen.append(told)
    plain = Batch(ForwardMode.DECODE, [make_req("a", [1, 2])], [1])
    verify = Batch(ForwardMode.EXTEND, [make_req("b", [1, 2])], [3], drafts=[[5, 6]])
    clock.launching(plain)
    now[0] += 0.05  # 20 ms of the plain step, then 30 ms drafting for the verify step
    clock.launching(verify, prepared_s=0.03)
    now[0] += 0.01
    clock.launching(None)
    assert [(k, n, after) for k, n, _, after in seen] == [("decode", 1, "verify"),
                                                          ("verify", 1, "none")]  # fmt: skip
    assert [round(t, 6) for _, _, t, _ in seen] == [0.02, 0.04]
    assert clock.counts["decode_steps"] == clock.counts["verify_steps"] == 1
    # (whole microseconds, truncated)
    assert abs(clock.counts["decode_us"] - 20_000) <= 1
    assert abs(clock.counts["verify_us"] - 40_000) <= 1


def test_step_costs_are_not_held_by_one_slow_first_step() -> None:
    """A class's first plain step took 100 ms (one-time costs); the next took 5 ms: plain
    decoding (1 token / 5 ms) beats verify steps (2 tokens / 15 ms) from then on."""
    costs = probed(8, 2, 0.015)
    assert not costs.speculate(8)
    costs.observe("decode", 8, 0.100, "decode")
    assert costs.speculate(8)  # 2 / 15 ms against 1 / 100 ms
    costs.observe("decode", 8, 0.005, "decode")  # (a revisit's first plain step)
    assert not costs.speculate(8)
    for seconds in (0.005, 0.006, 0.005, 0.300):  # a median: one more slow step changes nothing
        costs.observe("decode", 8, seconds, "decode")
        assert not costs.speculate(8)


def test_a_plain_step_is_timed_only_before_another_plain_step() -> None:
    """The plain step before a verify step is waited for and its results processed before the
    drafts are built (no overlap): its launch-to-launch time is not what a run of plain steps
    takes, and counted, it made verify steps look better than they were. So only a plain step
    followed by a plain one is timed, and a class measures plain steps two in a row."""
    costs = probed(4, 2, 0.030)  # 2 tokens per request per verify step
    assert not costs.speculate(4)
    costs.observe("decode", 4, 0.040, "verify")  # waited for: not timed ...
    costs.observe("decode", 4, 0.040, "none")  # ... nor before an idle wait
    assert costs.classes[4].decode_s is None
    assert not costs.speculate(4)  # still no plain time: plain again
    costs.observe("decode", 4, 0.010, "decode")
    assert costs.classes[4].decode_s == 0.010
    assert not costs.speculate(4)  # 1 token / 10 ms beats 2 / 30 ms


def test_verify_steps_keep_within_the_largest_graph() -> None:
    """A verify step of more tokens than the largest decode graph runs as one eager extend,
    many plain steps' worth at large batches: drafts are cut as evenly as they go (the oldest
    requests keep one more) so that the step replays the graph. 4 requests of 1 own token and
    4 n-gram drafts each, graphs of 10 rows: 2, 2, 1, 1 drafts (the two oldest first)."""
    config = EngineConfig(model="m", speculative_algorithm="ngram", speculative_num_draft_tokens=5)
    cache = make_cache(1, num_pages=256, max_reqs=4)
    stats = {"spec_verify_steps": 0, "spec_accepted_tokens": 0}
    spec = Speculator(config, cache, stats, graph_rows=10)
    period = [1, 2, 3, 4, 5, 6]
    reqs = [make_req(f"r{i}", period * 3, arrival=3 - i) for i in range(4)]  # r3 oldest
    for req in reqs:
        prefill(cache, req, token=1)  # the next tokens repeat the period: 2, 3, 4, 5
    batch = spec.build(reqs)
    assert batch.drafts == [[2], [2], [2, 3], [2, 3]], batch.drafts
    assert batch.extend_lens == [2, 2, 3, 3] and sum(batch.extend_lens) == 10
    wide = Speculator(config, cache, stats, graph_rows=0)  # no graphs: no cut
    for req, d in zip(reqs, batch.drafts, strict=True):  # give the slots back
        free_tail(cache, req, req.kv_len + 1, req.kv_len + 1 + len(d))
    assert wide.build(reqs).drafts == [[2, 3, 4, 5]] * 4


def test_draft_model_verify_steps_keep_within_the_largest_graph() -> None:
    """The draft model runs k = the largest share ahead for every drafting request, over
    positions up to seq_len + k - 2, so each request's slots (its own token and its share of
    drafts) must reach there: shares differ by at most one, which they do. Each request gets
    its share of the proposal and of its distributions."""
    config = EngineConfig(model="m", speculative_algorithm="draft", speculative_num_draft_tokens=5,
                          speculative_draft_model_path="d")  # fmt: skip
    cache = make_cache(1, num_pages=256, max_reqs=4)
    asked: list[int] = []

    def propose(reqs: list[Req], k: int) -> tuple[list[list[int]], list[Any]]:
        asked.append(k)
        for r in reqs:  # as DraftRunner._check: every position it runs has a slot
            assert r.row is not None
            assert (cache.table.cpu[r.row, r.seq_len - 1 : r.seq_len + k - 1] >= 1).all()
        return [[10 + j for j in range(k)] for _ in reqs], [torch.rand(k, 7) for _ in reqs]

    stats = {"spec_verify_steps": 0, "spec_accepted_tokens": 0}
    spec = Speculator(config, cache, stats, propose, graph_rows=10)
    reqs = [make_req(f"r{i}", [1, 2, 3], max_new_tokens=32, arrival=3 - i) for i in range(4)]
    for req in reqs:
        prefill(cache, req, token=1)
    batch = spec.build(reqs)
    assert asked == [2]
    assert batch.drafts == [[10], [10], [10, 11], [10, 11]], batch.drafts
    assert [r.draft_probs.shape[0] for r in reqs] == [1, 1, 2, 2]
