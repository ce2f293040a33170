"""Decode batches on CPU: retract_for_decode and build_decode_batch (no model runs: after a forward
of n tokens `req.kv_len += n`, after sampling `req.output_ids.append(tok)`)."""

from __future__ import annotations

import pytest
from kv_helpers import PAGE_SIZES, make_req, release_all
from sched_helpers import (
    assert_untouched,
    make_adder,
    make_cache,
    promised,
    run_extend,
    start_running,
)

from weft.runtime.executor.batch import ForwardMode
from weft.runtime.scheduler.decode import build_decode_batch, retract_for_decode
from weft.runtime.scheduler.prefill import PrefillAdder

##### retract_for_decode and build_decode_batch #####

RETRACT_CASES = [
    # (prompt lengths in pages, oldest first; pool pages; retracted arrivals, newest first)
    ([2, 2, 2], 6, [3]),
    ([6, 6, 1, 1], 14, [4, 3]),
    ([2, 2, 2], 9, []),  # a decode step fits: nothing retracted
    ([3, 3], 6, [2]),
]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("tree", ["radix", "none"])
@pytest.mark.parametrize(("pages", "pool", "retracted"), RETRACT_CASES)
def test_retract_newest_first_until_one_decode_step_fits(
    page_size: int, tree: str, pages: list[int], pool: int, retracted: list[int]
) -> None:
    p = page_size
    cache = make_cache(p, num_pages=pool + 1, tree=tree)
    prompts = [[10 * i + 1] * (n * p) for i, n in enumerate(pages)]
    running = start_running(cache, prompts)
    kv_before = {r.arrival: r.kv_len for r in running}
    shuffled = running[1:] + running[:1]  # the order of `running` must not matter
    evictable = cache.tree.evictable_size()
    out = retract_for_decode(shuffled, cache)
    assert [r.arrival for r in out] == retracted
    kept = [r for r in running if r not in out]
    assert 1 in {r.arrival for r in kept}
    for req in out:
        assert_untouched(req)
        assert req.num_retractions == 1 and len(req.output_ids) == 1
    moved = sum(kv_before[a] for a in retracted)
    if tree == "radix":
        assert cache.tree.evictable_size() == evictable + moved
        assert all(cache.match_len(r) == kv_before[r.arrival] for r in out)
    assert sum(cache.pages_needed(r, 1) for r in kept) * p <= cache.available_tokens
    free = cache.allocator.free_slots
    batch = build_decode_batch(kept, cache)
    assert batch.mode == ForwardMode.DECODE and batch.extend_lens == [1] * len(kept)
    assert batch.reqs == kept and batch.reqs is not kept
    if tree == "none" or not out:
        assert cache.allocator.free_slots == free - len(kept) * p
    for req in kept:  # the decode forward
        req.kv_len += 1
        req.output_ids.append(8)
    release_all(cache, running)


def test_retract_never_takes_the_oldest() -> None:
    """Even when retracting everyone else frees nothing, the oldest stays (the boundary caps a
    single request at the pool size, so it always fits in practice)."""
    cache = make_cache(1, num_pages=7)  # 6 slots
    oldest, newer = start_running(cache, [[1, 2, 3, 4, 5], [1, 2, 3]])
    assert newer.prefix_len == 3 and cache.allocator.free_slots == 1  # newer owns no slot
    held_elsewhere = cache.allocator.alloc_pages(1)
    assert held_elsewhere is not None and cache.available_tokens == 0
    assert retract_for_decode([newer, oldest], cache) == [newer]
    assert cache.available_tokens == 0  # retracting it freed nothing: its KV is oldest's
    assert oldest.row is not None and oldest.num_retractions == 0
    assert retract_for_decode([oldest], cache) == []
    cache.allocator.free(cache.allocator.page_slots(held_elsewhere))
    release_all(cache, [oldest])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_build_decode_batch_allocates_one_slot_per_request(page_size: int) -> None:
    p = page_size
    cache = make_cache(p)
    lengths = [p, 2 * p - 1, p + 1, 3 * p]  # kv_len after prefill (the sampled token not in KV)
    running = start_running(cache, [[7 + i] * n for i, n in enumerate(lengths)])
    assert [r.kv_len for r in running] == lengths
    free = cache.allocator.free_slots
    old_rows = [cache.table.table[r.row, : r.kv_len].tolist() for r in running]
    build_decode_batch(running, cache)
    new_pages = sum(n % p == 0 for n in lengths)
    assert free - cache.allocator.free_slots == new_pages * p
    new_slots = []
    for req, old in zip(running, old_rows, strict=True):
        row = cache.table.table[req.row, : req.kv_len + 1].tolist()
        assert row[:-1] == old and row[-1] % p == req.kv_len % p
        if req.kv_len % p:
            assert row[-1] == old[-1] + 1  # the partial page is filled first
        new_slots.append(row[-1])
        req.kv_len += 1
    assert len(set(new_slots)) == len(running) and min(new_slots) >= p
    release_all(cache, running)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("tree", ["radix", "none"])
def test_a_request_whose_first_chunk_is_admitted_can_finish_its_prompt(
    page_size: int, tree: str
) -> None:
    """Nothing else changes between the two steps, so the second chunk must be admitted too
    (either the first one is refused up front, or its admission reserves the rest)."""
    p = page_size
    cache = make_cache(p, num_pages=13, tree=tree)  # 12 pages
    # prompt 8 pages + its decodes 4 pages (8 * 0.5) beside a running request's 4 pages > 12
    req = make_req("c", [1] * (8 * p), max_new_tokens=8 * p)

    def adder() -> PrefillAdder:
        return make_adder(cache, chunk_size=4 * p, running=[promised(4 * p)], ratio=0.5)

    first = adder()
    if not first.add(req):
        return  # refused up front: consistent
    assert first.chunked is req and first.extend_lens == [4 * p]
    batch = first.batch()
    assert batch is not None
    run_extend(cache, batch)
    assert adder().add(req), "first chunk admitted, second refused: the request cannot finish"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_running_request_with_a_tiny_reserve_is_not_an_idle_system(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=13)  # 12 pages
    running = start_running(cache, [[1] * (6 * p)])  # 6 pages held, 7 tokens still to decode
    adder = make_adder(cache, running=running, ratio=0.1, idle=False)
    req = make_req("new", [2] * (6 * p), max_new_tokens=20 * p)  # expected to grow 2 pages
    assert not adder.add(req), "6 pages free: the prompt fits, with its own decodes it does not"
