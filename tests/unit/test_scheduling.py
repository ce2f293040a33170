"""Scheduling policy on CPU: order_waiting, PrefillAdder (retraction and decode batches:
test_decode_batch.py; the forecast of KV use and the new-token ratio: test_admission.py).

No model runs: after a forward of n tokens `req.kv_len += n`, after sampling
`req.output_ids.append(tok)`. test_mini_scheduler.py replays the whole step over a workload.
"""

from __future__ import annotations

import pytest
from kv_helpers import PAGE_SIZES, make_req, release_all, seed_tree
from sched_helpers import (
    assert_untouched,
    ignoring_eos,
    make_adder,
    make_cache,
    promised,
    run_and_release,
    run_extend,
    state,
)

from weft.runtime.executor.batch import ForwardMode
from weft.runtime.scheduler.prefill import LPM_MAX_WAITING, PrefillAdder, order_waiting

##### order_waiting #####


def test_fcfs_is_arrival_order() -> None:
    cache = make_cache(1)
    seed_tree(cache, [1, 2, 3, 4, 5, 6])
    reqs = [make_req(f"r{a}", [1, 2, 3, 4, 5, 6, a], arrival=a) for a in (3, 1, 4, 2)]
    reqs.append(make_req("r0", [9], arrival=0))
    assert [r.arrival for r in order_waiting(reqs, "fcfs", cache)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lpm_puts_the_longest_cached_prefix_first(page_size: int) -> None:
    p = page_size
    cache = make_cache(p)
    base = list(range(100, 100 + 4 * p))
    seed_tree(cache, base)
    prompts = {  # arrival: (prompt, cached prefix)
        1: ([7] * (4 * p + 1), 0),
        2: ([*base[: 2 * p], 1, 2, 3], 2 * p),
        3: ([*base, 5], 4 * p),
        4: ([*base[: 2 * p], 8] * 2, 2 * p),
        5: ([*base, 6, 6], 4 * p),
    }
    reqs = [make_req(f"r{a}", prompts[a][0], arrival=a) for a in (4, 1, 5, 2, 3)]
    assert {r.arrival: cache.match_len(r) for r in reqs} == {a: m for a, (_, m) in prompts.items()}
    assert [r.arrival for r in order_waiting(reqs, "lpm", cache)] == [3, 5, 2, 4, 1]
    assert [r.arrival for r in order_waiting(reqs, "fcfs", cache)] == [1, 2, 3, 4, 5]
    assert cache.tree.protected_size() == 0 and cache.table.available == cache.table.max_reqs
    assert all(r.row is None for r in reqs)


def test_lpm_falls_back_to_fcfs_for_long_queues() -> None:
    cache = make_cache(1)
    seed_tree(cache, [1, 2, 3, 4])
    reqs = [make_req(f"r{a}", [9, a], arrival=a) for a in range(LPM_MAX_WAITING)]
    reqs.append(make_req("hit", [1, 2, 3, 4, 5], arrival=LPM_MAX_WAITING))
    assert order_waiting(reqs, "lpm", cache)[-1].rid == "hit"
    assert order_waiting(reqs[1:], "lpm", cache)[0].rid == "hit"


def steps(adder: PrefillAdder) -> list[int]:
    """How many more tokens the adder's forecast expects of each request counted."""
    return [e for e, _ in adder.forecast.entries()]


##### PrefillAdder: token budget, chunking, request slots #####


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_respects_the_token_budget(page_size: int) -> None:
    cache = make_cache(page_size)
    shared = list(range(50, 58))
    seed_tree(cache, shared)  # so the refused request locks a prefix while it is tried
    adder = make_adder(cache, token_budget=16, ratio=0.5)
    a, b = make_req("a", [1] * 6, max_new_tokens=4), make_req("b", [2] * 6, max_new_tokens=6)
    assert adder.add(a) and adder.add(b)
    assert (adder.extend_lens, adder.token_budget, steps(adder)) == ([6, 6], 4, [2, 3])
    before = state(cache)
    c = make_req("c", [*shared, 3, 3, 3, 3, 3])  # 8 cached, 5 new > 4 left
    assert not adder.add(c)
    assert_untouched(c)
    assert state(cache) == before
    batch = adder.batch()
    assert batch is not None and batch.mode == ForwardMode.EXTEND
    assert (batch.reqs, batch.extend_lens, batch.num_tokens) == ([a, b], [6, 6], 12)
    run_and_release(cache, adder)


def test_adder_budget_counts_only_new_tokens() -> None:
    cache = make_cache(1)
    seed_tree(cache, list(range(20)))
    adder = make_adder(cache, token_budget=5)
    req = make_req("r", list(range(24)))
    assert adder.add(req)
    assert req.prefix_len == 20 and adder.extend_lens == [4] and adder.token_budget == 1
    run_and_release(cache, adder)


def test_empty_adder_has_no_batch() -> None:
    assert make_adder(make_cache(1)).batch() is None


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_chunks_a_long_prompt(page_size: int) -> None:
    chunk = 2 * page_size
    cache = make_cache(page_size)
    req = make_req("r", list(range(4 * page_size + 1)), max_new_tokens=4)
    other = make_req("o", [1, 2, 3])
    seen = []
    while req.extend_len > 0 and not req.output_ids:
        adder = make_adder(cache, chunk_size=chunk, ratio=1.0)
        assert adder.add(req)
        seen.append(adder.extend_lens[0])
        if adder.chunked is not None:
            assert adder.chunked is req
            assert not adder.add(other)  # a chunked request ends the batch
            assert_untouched(other)
        else:
            assert steps(adder) == [4]
        batch = adder.batch()
        assert batch is not None
        run_extend(cache, batch)
        assert req.prefix_len == req.kv_len - req.kv_len % page_size
    assert seen == [chunk, chunk, 1]
    slots = cache.table.table[req.row, : req.kv_len].tolist()
    assert len(set(slots)) == len(slots) and min(slots) >= page_size
    release_all(cache, [req])


def test_adder_chunks_the_request_that_hits_the_budget() -> None:
    cache = make_cache(1)
    adder = make_adder(cache, token_budget=10, chunk_size=8)
    a, b, c = make_req("a", [1] * 6), make_req("b", [2] * 10), make_req("c", [3])
    assert adder.add(a) and adder.add(b)
    assert adder.extend_lens == [6, 4] and adder.chunked is b
    assert not adder.add(c)
    assert_untouched(c)
    run_and_release(cache, adder)


def test_without_chunking_an_over_budget_prompt_runs_alone() -> None:
    cache = make_cache(1)
    alone = make_adder(cache, token_budget=8, chunk_size=0)
    big, small = make_req("big", [1] * 20), make_req("small", [2])
    assert alone.add(big)
    assert alone.extend_lens == [20] and alone.chunked is None and alone.token_budget < 0
    assert not alone.add(small)
    assert_untouched(small)

    adder = make_adder(cache, token_budget=8, chunk_size=0)
    first, big2 = make_req("first", [3, 3]), make_req("big2", [4] * 20)
    assert adder.add(first)
    before = state(cache)
    assert not adder.add(big2)
    assert_untouched(big2)
    assert state(cache) == before
    run_and_release(cache, alone, adder)


@pytest.mark.parametrize("max_new_reqs", [0, 1, 2])
def test_adder_max_new_reqs(max_new_reqs: int) -> None:
    cache = make_cache(1)
    adder = make_adder(cache, max_new_reqs=max_new_reqs)
    reqs = [make_req(f"r{i}", [i, i]) for i in range(3)]
    added = [adder.add(r) for r in reqs]
    assert added == [i < max_new_reqs for i in range(3)]
    assert cache.table.available == cache.table.max_reqs - max_new_reqs
    run_and_release(cache, adder)


def test_adder_stops_when_no_request_slot_is_free() -> None:
    cache = make_cache(1, max_reqs=1)
    adder = make_adder(cache)
    a, b = make_req("a", [1]), make_req("b", [2])
    assert adder.add(a) and not adder.add(b)
    assert_untouched(b)
    run_and_release(cache, adder)


##### PrefillAdder: memory #####

# pool: 8 slots (page size 1); a running request that holds nothing will take `promised` more
# slots (None: nothing runs); the new one's prompt takes 3 now, then it grows by `max_new`
# (ignore_eos), or by ceil(max_new * ratio) without; each gives its slots back when it ends, so
# the peak is the larger of "both growing until the first ends" and "the later one alone"
MEMORY_CASES = [
    # (promised, max_new, ratio (None: ignore_eos), admitted)
    (5, 1, None, True),  # 3 + max(2 * 1, 5 - 3) == 5
    (5, 5, None, False),  # both grow 5: 3 + 10
    (2, 5, None, True),  # 3 + max(2 * 2, 5) == 8: the new one alone, once the other ended
    (2, 6, None, False),  # 3 + 6 == 9
    (5, 10, 0.5, False),  # expected to grow 5: as (5, 5)
    (5, 10, 0.1, True),  # expected to grow 1: as (5, 1)
    (8, 1, None, True),  # the new one ends first and gives its 4 back: 3 + max(2, 8 - 3) == 8
    (9, 1, None, False),  # ... and the running one still outgrows the pool: 3 + 9 - 3 > 8
    (None, 100, None, True),  # alone in an idle system: admitted
    (0, 100, None, False),  # something runs: its future counts
]


@pytest.mark.parametrize(("promise", "max_new", "ratio", "admitted"), MEMORY_CASES)
def test_adder_memory_check(
    promise: int | None, max_new: int, ratio: float | None, admitted: bool
) -> None:
    cache = make_cache(1, num_pages=9)
    running = [] if promise is None else [promised(promise)]
    adder = make_adder(
        cache, token_budget=1000, running=running, ratio=ratio or 0.0, idle=promise is None
    )
    req = make_req("r", [1] * 3, max_new_tokens=max_new)
    if ratio is None:
        req = ignoring_eos(req, max_new)
    before = state(cache)
    assert adder.add(req) is admitted
    if not admitted:
        assert_untouched(req)
        assert state(cache) == before and adder.reqs == []
    run_and_release(cache, adder)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_memory_check_counts_a_partial_page_per_request(page_size: int) -> None:
    """Each growing request may need a page it fills only partly: page_size - 1 slots more."""
    p = page_size
    cache = make_cache(p, num_pages=9)  # 8 pages
    most = 5 * p // 2 - (p - 1)  # both grow together: 3p + 2 * (most + p - 1) <= 8p
    for promise, admitted in ((most, True), (most + 1, False)):
        adder = make_adder(cache, running=[promised(promise)], idle=False)
        req = ignoring_eos(make_req("r", [1] * (3 * p)), promise)
        assert adder.add(req) is admitted, promise
        run_and_release(cache, adder)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_counts_evictable_as_available(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=9)
    seed_tree(cache, [5] * (6 * p))  # 6 pages evictable, 2 free
    adder = make_adder(cache, running=[promised(2 * p)], idle=False)
    req = ignoring_eos(make_req("r", [1] * (4 * p)), 1)
    assert adder.add(req)  # 4 + 2 (both grow a token) <= 2 free + 6 evictable: evicts in alloc
    assert cache.tree.evictable_size() <= 4 * p
    assert not adder.add(ignoring_eos(make_req("s", [2] * (3 * p)), 1))  # 3 + 3 > 4 left
    run_and_release(cache, adder)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_refusal_unlocks_the_matched_prefix(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=9)
    seed_tree(cache, [5] * (4 * p))
    adder = make_adder(cache, running=[promised(6 * p)], idle=False)
    req = ignoring_eos(make_req("r", [5] * (4 * p) + [1] * (3 * p)), 8)
    before = state(cache)
    assert not adder.add(req)
    assert_untouched(req)
    assert state(cache) == before
    cache.check_conservation()
