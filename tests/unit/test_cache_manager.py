"""KVCacheManager on CPU (no model): admission against the radix cache, page allocation and
eviction.

The model is simulated: after a forward of n tokens `req.kv_len += n`, after sampling
`req.output_ids.append(tok)`. Every scenario ends with all requests released and
`check_conservation()` passing (free + evictable + protected == total, no row held).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_helpers import (
    BASE,
    PAGE_SIZES,
    assert_accounted,
    forward,
    make_cache,
    make_req,
    prefill,
    release_all,
    row_slots,
    seed_tree,
)

from weft.runtime.executor.memory import ReqToTokenPool

TREES = ["radix", "none"]


##### KVCacheManager: admit #####


ADMIT_CASES = [
    # (page_size, cached prompt length, new prompt, Req kwargs, expected prefix_len)
    (1, 10, BASE[:10], {}, 9),  # same prompt: the last token is always recomputed
    (1, 10, BASE[:12], {}, 10),
    (1, 10, BASE[:6], {}, 5),
    (1, 10, [*BASE[:3], 7, 8], {}, 3),
    (1, 10, BASE[:12], {"return_logprob": True, "logprob_start_len": 4}, 3),
    (1, 10, BASE[:12], {"return_logprob": True, "logprob_start_len": 1}, 0),
    (1, 10, BASE[:12], {"return_logprob": True, "logprob_start_len": 0}, 0),
    (1, 10, BASE[:12], {"return_logprob": True, "logprob_start_len": -1}, 10),
    (1, 10, BASE[:12], {"return_logprob": False, "logprob_start_len": 4}, 10),
    (4, 12, BASE[:12], {}, 8),  # cap 11 -> whole pages: 8
    (4, 12, BASE[:13], {}, 12),
    (4, 12, BASE[:16], {}, 12),
    (4, 12, BASE[:9], {}, 8),
    (4, 12, BASE[:8], {}, 4),
    (4, 12, [*BASE[:6], 7, 8, 9, 10], {}, 4),  # differs inside the 2nd page
    (4, 12, BASE[:16], {"return_logprob": True, "logprob_start_len": 9}, 8),
    (4, 12, BASE[:16], {"return_logprob": True, "logprob_start_len": 8}, 4),
]


@pytest.mark.parametrize(("page_size", "cached", "prompt", "kwargs", "expected"), ADMIT_CASES)
def test_admit_gives_the_capped_cached_prefix(
    page_size: int, cached: int, prompt: list[int], kwargs: dict[str, Any], expected: int
) -> None:
    cache = make_cache(page_size)
    seed_tree(cache, BASE[:cached])
    in_tree = cache.tree.evictable_size()
    assert in_tree == cached
    req = make_req("r", prompt, **kwargs)
    assert cache.match_len(req) == expected
    assert cache.tree.protected_size() == 0  # match_len locks nothing
    assert cache.admit(req)
    assert req.row is not None and cache.table.available == cache.table.max_reqs - 1
    assert req.prefix_len == req.kv_len == expected
    assert req.extend_len == len(prompt) - expected
    assert row_slots(cache, req) == cache.tree.match_prefix(prompt[:expected]).indices.tolist()
    assert cache.tree.protected_size() == expected
    assert cache.tree.evictable_size() == in_tree - expected
    release_all(cache, [req])


def test_admit_after_retraction_ignores_the_logprob_cap() -> None:
    """Input logprobs are computed on the first prefill only; a retracted request reuses its KV."""
    cache = make_cache(1)
    seed_tree(cache, BASE[:10])
    req = make_req("r", BASE[:8], return_logprob=True, logprob_start_len=2)
    req.output_ids = [BASE[8], BASE[9], 5]
    req.input_logprob_next = 8  # the first prefill delivered every prompt logprob
    assert cache.admit(req)
    assert req.prefix_len == 10


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_admit_with_no_cache_never_matches(page_size: int) -> None:
    cache = make_cache(page_size, tree="none")
    seed_tree(cache, BASE)
    assert cache.allocator.free_slots == cache.allocator.total_slots
    req = make_req("r", BASE)
    assert cache.match_len(req) == 0
    assert cache.admit(req)
    assert req.prefix_len == req.kv_len == 0
    release_all(cache, [req])


def test_admit_without_a_free_row_takes_nothing() -> None:
    cache = make_cache(1, max_reqs=1)
    seed_tree(cache, BASE[:10])
    first = make_req("a", [1, 2, 3])
    assert cache.admit(first)
    second = make_req("b", BASE[:10])
    assert not cache.admit(second)
    assert second.row is None and second.kv_len == 0 and second.last_node is None
    assert cache.tree.protected_size() == 0
    release_all(cache, [first])


##### KVCacheManager: alloc #####


@pytest.mark.parametrize(
    ("page_size", "kv_len", "n", "pages"),
    [
        (1, 0, 5, 5),
        (1, 3, 0, 0),
        (4, 0, 0, 0),
        (4, 0, 1, 1),
        (4, 0, 4, 1),
        (4, 0, 5, 2),
        (4, 3, 1, 0),  # fills the partial last page
        (4, 3, 2, 1),
        (4, 4, 1, 1),
        (4, 5, 3, 0),
        (4, 5, 8, 2),  # 3 into the partial page, 5 more: 2 pages
        (4, 6, 11, 3),
    ],
)
def test_pages_needed(page_size: int, kv_len: int, n: int, pages: int) -> None:
    cache = make_cache(page_size)
    req = make_req("r", [1] * 20)
    req.kv_len = kv_len
    assert cache.pages_needed(req, n) == pages


@pytest.mark.parametrize(
    ("page_size", "sizes", "row", "pages_taken"),
    [
        (1, [3, 1, 2], [1, 2, 3, 4, 5, 6], 6),
        (4, [6, 1, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 3),
        (4, [4, 4], [4, 5, 6, 7, 8, 9, 10, 11], 2),
        (4, [1, 1, 1, 1, 1], [4, 5, 6, 7, 8], 2),
        (4, [3, 6], [4, 5, 6, 7, 8, 9, 10, 11, 12], 3),
        (4, [2, 0, 2], [4, 5, 6, 7], 1),
    ],
)
def test_alloc_fills_the_partial_last_page_first(
    page_size: int, sizes: list[int], row: list[int], pages_taken: int
) -> None:
    cache = make_cache(page_size)
    req = make_req("r", list(range(20)))
    assert cache.admit(req)
    for n in sizes:
        free = cache.allocator.free_slots
        expected_pages = cache.pages_needed(req, n)
        forward(cache, req, n)
        assert free - cache.allocator.free_slots == expected_pages * page_size
    assert row_slots(cache, req) == row
    assert cache.allocator.free_slots == cache.allocator.total_slots - pages_taken * page_size
    release_all(cache, [req])


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batched_decode_alloc_equals_one_request_at_a_time(page_size: int, mirror: bool) -> None:
    """alloc_decode (the decode hot path) takes the same slots and pages as alloc(req, 1) for
    each request in order, with requests on partial pages and at page boundaries."""
    tables = []
    for batched in (False, True):
        cache = make_cache(page_size, num_pages=512 // page_size + 16, max_reqs=6, max_context=96)
        if mirror:
            cache.table = ReqToTokenPool(6, 96, "cpu", mirror=True)
        reqs = [make_req(f"r{i}", list(range(3 + 5 * i))) for i in range(6)]
        for req in reqs:
            prefill(cache, req)
        for _ in range(2 * page_size + 1):  # crosses page boundaries at different steps
            if batched:
                assert cache.alloc_decode(reqs)
            else:
                assert all(cache.alloc(r, 1) for r in reqs)
            for req in reqs:
                req.kv_len += 1
                req.output_ids.append(9)
            cache.table.flush()  # what the accounting reads
            assert_accounted(cache, reqs)
        cache.table.flush()
        assert torch.equal(cache.table.table, cache.table.cpu)
        tables.append((cache.table.cpu.clone(), cache.allocator.free_slots))
        release_all(cache, reqs)
    assert torch.equal(tables[0][0], tables[1][0]) and tables[0][1] == tables[1][1]


def test_batched_decode_alloc_fails_cleanly_when_the_pool_is_full() -> None:
    cache = make_cache(4, num_pages=4, max_reqs=3)  # 3 usable pages
    reqs = [make_req(f"r{i}", [1, 2, 3, 4]) for i in range(3)]
    for req in reqs:
        prefill(cache, req)  # one full page each: the next token needs a fresh page
    before = cache.table.cpu.clone()
    assert not cache.alloc_decode(reqs)
    assert cache.allocator.free_slots == 0 and torch.equal(cache.table.cpu, before)
    release_all(cache, reqs)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_after_a_cached_prefix_starts_a_new_page(page_size: int) -> None:
    cache = make_cache(page_size)
    seed_tree(cache, BASE[:8])
    req = make_req("r", BASE[:8] + [1, 2, 3])
    assert cache.admit(req) and req.prefix_len == 8
    tree_slots = row_slots(cache, req)
    forward(cache, req, 3)
    slots = row_slots(cache, req)
    assert slots[:8] == tree_slots
    assert slots[8] % page_size == 0 and slots[8:] == [slots[8] + i for i in range(3)]
    assert not set(slots[8:]) & set(tree_slots)
    assert_accounted(cache, [req])
    release_all(cache, [req])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_evicts_least_recently_used_when_short(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=7)  # 6 usable pages
    old, new = [1] * (4 * p), [2] * (2 * p)
    seed_tree(cache, old)
    seed_tree(cache, new)
    assert cache.allocator.free_slots == 0 and cache.tree.evictable_size() == 6 * p
    assert cache.available_tokens == 6 * p
    req = make_req("r", [3] * (2 * p))
    assert cache.admit(req)
    forward(cache, req, 2 * p)  # short by 2 pages: the older entry goes, whole
    assert cache.tree.evictable_size() == 2 * p
    assert cache.allocator.free_slots == 2 * p
    assert cache.match_len(make_req("n", [*new, 9])) == 2 * p
    assert cache.match_len(make_req("o", [*old, 9])) == 0
    assert_accounted(cache, [req])
    release_all(cache, [req])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_fails_cleanly_when_nothing_is_evictable(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=4)  # 3 usable pages
    holder = make_req("a", [1] * (2 * p) + [2])
    prefill(cache, holder)
    cache.cache_req(holder, release=False)  # its prefix is locked in the tree
    req = make_req("b", [5] * (2 * p))
    assert cache.admit(req)
    assert cache.allocator.free_slots == 0
    before = (cache.allocator.free_slots, cache.tree.protected_size(), row_slots(cache, req))
    assert not cache.alloc(req, 2 * p)
    after = (cache.allocator.free_slots, cache.tree.protected_size(), row_slots(cache, req))
    assert after == before
    release_all(cache, [holder, req])
