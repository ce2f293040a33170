"""Admission by predicted peak KV use, on CPU without a model: the new-token ratio (start, decay,
floor, raise after a retraction, reset; built from EngineConfig's knobs, which are validated), the
tokens a request is expected still to generate, the forecast's peak, and the slots a request gives
back when it ends (its own and the cached prefix only it locks)."""

from __future__ import annotations

import math

import pytest
from kv_helpers import make_req, release_all
from sched_helpers import ignoring_eos, make_adder, make_cache, run_extend

from weft.runtime.config import EngineConfig
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.admission import (
    DECODE_RESERVE_CLIP,
    KVForecast,
    NewTokenRatio,
    expected_new_tokens,
)

##### NewTokenRatio #####


def test_ratio_defaults_are_sglangs() -> None:
    ratio = NewTokenRatio.from_config(EngineConfig())
    assert ratio.current == ratio.init == 0.7
    assert ratio.floor == pytest.approx(0.7 * 0.14)
    assert ratio.decay == pytest.approx((0.7 - 0.098) / 600)
    assert ratio.retract_steps == 20


def test_ratio_decays_to_its_floor_in_the_decay_steps_then_stays() -> None:
    config = EngineConfig(init_new_token_ratio=0.5, min_new_token_ratio_factor=0.2,
                          new_token_ratio_decay_steps=10)  # fmt: skip
    ratio = NewTokenRatio.from_config(config)
    seen = []
    for _ in range(12):
        ratio.decay_step()
        seen.append(ratio.current)
    assert seen[0] == pytest.approx(0.5 - 0.04)
    assert seen[8] > 0.1 and seen[9] == pytest.approx(0.1) and seen[11] == pytest.approx(0.1)
    ratio.reset()
    assert ratio.current == 0.5


@pytest.mark.parametrize(("conservativeness", "init", "floor"), [(2.0, 1.0, 0.14), (0.5, 0.35, 0.049), (0.0, 0.0, 0.0)])  # fmt: skip
def test_conservativeness_scales_the_ratio(conservativeness: float, init: float, floor: float) -> None:  # fmt: skip
    ratio = NewTokenRatio.from_config(EngineConfig(schedule_conservativeness=conservativeness))
    assert (ratio.init, ratio.floor) == (pytest.approx(init), pytest.approx(floor))


def test_a_retraction_raises_the_ratio_to_what_the_running_requests_showed() -> None:
    ratio = NewTokenRatio(init=0.7, floor=0.1, decay=0.1, retract_steps=20)
    ratio.current = 0.1
    running = [make_req("a", [1], max_new_tokens=100), make_req("b", [1], max_new_tokens=99)]
    running[0].output_ids = [5] * 60
    running[1].output_ids = [5] * 40
    ratio.raise_after_retract(running)
    assert ratio.current == pytest.approx((100 + 2 * 20) / (199 + 1))
    ratio.raise_after_retract([make_req("c", [1], max_new_tokens=1000)])  # shows 20/1001
    assert ratio.current == pytest.approx(0.7), "a retraction never lowers the ratio"
    running[0].output_ids, running[1].output_ids = [5] * 100, [5] * 99
    ratio.raise_after_retract(running)
    assert ratio.current == 1.0, "capped at 1"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("schedule_conservativeness", -0.1),
        ("schedule_conservativeness", math.inf),
        ("init_new_token_ratio", 0.0),
        ("init_new_token_ratio", 1.5),
        ("init_new_token_ratio", math.nan),
        ("min_new_token_ratio_factor", 1.01),
        ("min_new_token_ratio_factor", -1.0),
        ("new_token_ratio_decay_steps", 0),
        ("retract_decode_steps", -1),
        ("new_token_ratio_decay_steps", 1.5),
    ],
)
def test_ratio_knobs_are_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_ratio_knobs_are_serve_options(capsys: pytest.CaptureFixture[str]) -> None:
    from weft import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--schedule-conservativeness", "--init-new-token-ratio",
                 "--min-new-token-ratio-factor", "--new-token-ratio-decay-steps",
                 "--retract-decode-steps"):  # fmt: skip
        assert flag in text
    assert "expected to use" in text


##### expected_new_tokens #####


@pytest.mark.parametrize(
    ("max_new", "out", "ahead", "ignore_eos", "min_new", "ratio", "expected"),
    [
        (100, 0, 0, True, 0, 0.1, 100),  # ignore_eos: all of it, whatever the ratio
        (100, 30, 1, True, 0, 0.1, 69),  # ... of what is left (a token in flight counts)
        (100, 0, 0, False, 0, 0.1, 10),
        (100, 30, 0, False, 0, 0.5, 35),  # the ratio of what is left
        (100, 0, 0, False, 0, 0.015, 2),  # rounded up
        (100, 0, 0, False, 0, 0.0, 0),
        (100, 10, 0, False, 50, 0.1, 40),  # min_new_tokens still owed
        (100, 60, 0, False, 50, 0.1, 4),  # ... once reached, the ratio
        (DECODE_RESERVE_CLIP * 3, 0, 0, False, 0, 0.5, DECODE_RESERVE_CLIP // 2),  # clipped
        (DECODE_RESERVE_CLIP * 3, 0, 0, True, 0, 0.5, DECODE_RESERVE_CLIP * 3),  # not clipped
        (100, 100, 0, True, 0, 1.0, 0),
    ],
)
def test_expected_new_tokens(
    max_new: int, out: int, ahead: int, ignore_eos: bool, min_new: int, ratio: float, expected: int
) -> None:
    req = make_req("r", [1], max_new_tokens=max_new)
    req.params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos,
                                min_new_tokens=min_new)  # fmt: skip
    req.output_ids, req.ahead = [5] * out, ahead
    assert expected_new_tokens(req, ratio) == expected


##### KVForecast.peak #####

# requests as (steps e_i until done, slots r_i given back then); page size 1; D(t) = the sum of
# min(t, e_i) over those running at t minus r_i over those done (`lag` steps after their last)
PEAK_CASES = [
    ([], 0, 0),
    ([(5, 0)], 0, 5),
    ([(5, 0), (5, 7)], 0, 10),  # grow together
    ([(2, 10), (5, 0)], 0, 4),  # 2 + 2 at t=2; then the first gives back 10: 5 - 10 < 4
    ([(2, 1), (5, 0)], 0, 4),  # t=5: 5 - 1 == 4 too
    ([(2, 0), (5, 0)], 0, 5),  # the second alone at t=5 (the first gave back nothing)
    ([(2, 10), (5, 0)], 1, 5),  # t=3: the first's slots are back a step late: 2 + 3
    ([(0, 3), (4, 0)], 0, 1),  # t=4: 4 - 3
    ([(0, 3), (4, 0)], 1, 1),  # t=1: 0 + 1; t=5: 4 - 3
    ([(1, 0), (1, 0), (3, 2)], 0, 3),  # three grow 1 each; then 3 - 0
]


@pytest.mark.parametrize(("entries", "lag", "peak"), PEAK_CASES)
def test_forecast_peak(entries: list[tuple[int, int]], lag: int, peak: int) -> None:
    forecast = KVForecast(make_cache(1), 1.0, lag, [])
    forecast.steps = sorted(e for e, _ in entries)
    forecast.released = [r for _, r in sorted(entries)]
    forecast.stale = False
    assert forecast.peak() == peak
    brute = max(
        [0]
        + [
            sum(min(t, e) for e, _ in entries if e + lag >= t)
            - sum(r for e, r in entries if e + lag < t)
            for t in range(1, 12)
        ]
    )
    assert brute == peak, "the case's own arithmetic"


def test_forecast_with_an_extra_entry_leaves_the_counted_ones() -> None:
    forecast = KVForecast(make_cache(1), 1.0, 0, [])
    forecast.stale = False
    forecast.steps, forecast.released = [2, 5], [10, 0]
    assert forecast.peak((5, 0)) == 3 * 2  # three grow 2 each, then 2 * 5 - 10
    assert forecast.peak() == 2 * 2
    assert forecast.entries() == [(2, 10), (5, 0)]


def test_forecast_counts_pages_partly_filled() -> None:
    """A request growing n tokens may take a page more than n / page_size."""
    forecast = KVForecast(make_cache(4), 1.0, 0, [])
    forecast.stale = False
    forecast.steps, forecast.released = [8, 8], [0, 0]
    assert forecast.peak() == 2 * (8 + 3)


##### KVCacheManager.releasable #####


def test_releasable_counts_a_shared_prefix_only_when_no_one_else_holds_it() -> None:
    cache = make_cache(1, num_pages=64, max_reqs=4)
    prompt = list(range(10, 30))
    first = ignoring_eos(make_req("a", prompt), 4)
    adder = make_adder(cache, token_budget=100)
    assert adder.add(first)
    batch = adder.batch()
    assert batch is not None
    run_extend(cache, batch)  # its prompt is in the tree, locked by it alone
    assert first.prefix_len == 20 and cache.releasable(first) == 20
    second = ignoring_eos(make_req("b", prompt + [7, 7]), 4)
    adder = make_adder(cache, token_budget=100, running=[first], idle=False)
    assert adder.add(second)
    assert second.prefix_len == 20
    assert cache.releasable(first) == 0 and cache.releasable(second) == 0, "shared: stays locked"
    # the forecast of the admission above counted the first again once the second locked its
    # prefix: the first gives back nothing now, the second its 2 new slots (not yet computed)
    assert sorted(adder.forecast.entries()) == [(3, 0), (4, 2)]  # (the first sampled one)
    batch = adder.batch()
    assert batch is not None
    run_extend(cache, batch)
    assert cache.releasable(second) == 2
    cache.cache_req(first, release=True)
    assert cache.releasable(second) == 22, "the last holder gives the prefix back"
    release_all(cache, [second])
