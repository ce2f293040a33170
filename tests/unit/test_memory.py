"""KV memory on CPU: PageAllocator, ReqToTokenPool, KVPool and KVCacheManager (no model).

The model is simulated: after a forward of n tokens `req.kv_len += n`, after sampling
`req.output_ids.append(tok)`. Every KVCacheManager scenario ends with all requests released and
`check_conservation()` passing (free + evictable + protected == total, no row held).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from tests.unit.kv_helpers import PAGE_SIZES, make_cache, make_req
from weft.runtime.cache_manager import KVCacheManager
from weft.runtime.memory import KVPool, PageAllocator, ReqToTokenPool
from weft.runtime.request import Req

TREES = ["radix", "none"]


##### Helpers #####


def aligned(n: int, page_size: int) -> int:
    return n - n % page_size


def row_slots(cache: KVCacheManager, req: Req) -> list[int]:
    assert req.row is not None
    return cache.table.table[req.row, : req.kv_len].tolist()


def forward(cache: KVCacheManager, req: Req, n: int) -> None:
    """Allocate and 'run' the next n tokens of the request."""
    assert cache.alloc(req, n)
    req.kv_len += n


def prefill(cache: KVCacheManager, req: Req, token: int = 7) -> None:
    """Admit (if needed), run the rest of fill_ids, sample one token."""
    if req.row is None:
        assert cache.admit(req)
    forward(cache, req, req.extend_len)
    req.output_ids.append(token)


def seed_tree(cache: KVCacheManager, prompt: Sequence[int]) -> None:
    """A finished request that leaves `prompt` (its full pages) in the tree, unlocked."""
    req = make_req("seed", prompt)
    prefill(cache, req)
    cache.cache_req(req, release=True)


def held_slots(cache: KVCacheManager, reqs: Sequence[Req]) -> int:
    """Slots in pages the requests own (table positions [prefix_len, kv_len))."""
    pages: set[int] = set()
    for req in reqs:
        if req.row is not None:
            own = cache.table.table[req.row, req.prefix_len : req.kv_len]
            pages |= set((own // cache.page_size).tolist())
    return len(pages) * cache.page_size


def assert_accounted(cache: KVCacheManager, reqs: Sequence[Req]) -> None:
    """Mid-run conservation: every slot is free, in the tree, or in a request's own pages."""
    tree = cache.tree
    parts = (
        cache.allocator.free_slots,
        tree.evictable_size(),
        tree.protected_size(),
        held_slots(cache, reqs),
    )
    assert sum(parts) == cache.allocator.total_slots, f"free/evictable/protected/held = {parts}"
    tree.check_integrity()


def release_all(cache: KVCacheManager, reqs: Sequence[Req]) -> None:
    for req in reqs:
        if req.row is not None:
            cache.cache_req(req, release=True)
    cache.check_conservation()


##### PageAllocator #####


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_zero_is_never_handed_out(page_size: int) -> None:
    alloc = PageAllocator(6, page_size, "cpu")
    assert [alloc.alloc_pages(1) for _ in range(5)] == [[1], [2], [3], [4], [5]]
    assert alloc.alloc_pages(1) is None
    alloc.free(alloc.page_slots([1, 2, 3, 4, 5]))
    assert sorted(alloc.alloc_pages(5) or []) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("num_pages", "page_size", "total_slots"),
    [(2, 1, 1), (8, 1, 7), (2, 4, 4), (8, 4, 28)],
)
def test_slot_counts(num_pages: int, page_size: int, total_slots: int) -> None:
    alloc = PageAllocator(num_pages, page_size, "cpu")
    assert alloc.total_slots == alloc.free_slots == total_slots
    alloc.alloc_pages(1)
    assert alloc.free_slots == total_slots - page_size
    assert alloc.total_slots == total_slots


@pytest.mark.parametrize("num_pages", [0, 1])
def test_pool_needs_a_page_beyond_the_reserved_one(num_pages: int) -> None:
    with pytest.raises(ValueError, match="more than 1 page"):
        PageAllocator(num_pages, 4, "cpu")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_free_round_trip(page_size: int) -> None:
    alloc = PageAllocator(8, page_size, "cpu")
    got = alloc.alloc_pages(3)
    assert got is not None and len(set(got)) == 3 and 0 not in got
    assert alloc.free_slots == 4 * page_size
    alloc.free(alloc.page_slots(got))
    assert alloc.free_slots == 7 * page_size
    assert sorted(alloc.alloc_pages(7) or []) == list(range(1, 8))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_more_than_free_takes_nothing(page_size: int) -> None:
    alloc = PageAllocator(5, page_size, "cpu")
    first = alloc.alloc_pages(2)
    assert alloc.alloc_pages(3) is None
    assert alloc.free_slots == 2 * page_size
    rest = alloc.alloc_pages(2)
    assert first is not None and rest is not None
    assert sorted(first + rest) == [1, 2, 3, 4]
    assert alloc.alloc_pages(0) == []


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("what", ["slot 0", "last slot of page 0", "page 0 with a real page"])
def test_freeing_the_reserved_page_asserts_and_frees_nothing(page_size: int, what: str) -> None:
    alloc = PageAllocator(4, page_size, "cpu")
    alloc.alloc_pages(1)  # page 1
    slots = {
        "slot 0": [0],
        "last slot of page 0": [page_size - 1],
        "page 0 with a real page": [page_size, 0],
    }[what]
    with pytest.raises(AssertionError, match="reserved"):
        alloc.free(torch.tensor(slots, dtype=torch.int64))
    assert alloc.free_slots == 2 * page_size


@pytest.mark.parametrize(
    ("page_size", "pages", "slots"),
    [
        (1, [3, 1], [3, 1]),
        (4, [2], [8, 9, 10, 11]),
        (4, [3, 1], [12, 13, 14, 15, 4, 5, 6, 7]),
        (4, [], []),
    ],
)
def test_page_slots_layout(page_size: int, pages: list[int], slots: list[int]) -> None:
    out = PageAllocator(8, page_size, "cpu").page_slots(pages)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == slots


def test_free_gives_back_each_touched_page_once() -> None:
    alloc = PageAllocator(4, 4, "cpu")
    assert alloc.alloc_pages(3) == [1, 2, 3]
    alloc.free(torch.tensor([5, 6], dtype=torch.int64))  # two slots of page 1: the page, once
    assert alloc.free_slots == 4
    alloc.free(torch.tensor([9], dtype=torch.int64))  # a partial tail: its whole page
    assert alloc.free_slots == 8
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert sorted(alloc.alloc_pages(2) or []) == [1, 2]
    assert alloc.alloc_pages(1) is None


def test_pages_are_handed_out_lowest_first_whatever_the_order_of_frees() -> None:
    """Freed pages scattered over the pool (finished requests, evictions) are reused from the
    pool's low end, so what is in use stays packed there."""
    alloc = PageAllocator(64, 16, "cpu")
    held = alloc.alloc_pages(63)
    assert held == list(range(1, 64))
    for pages in ([40, 41, 42], [7], [63, 20], [3, 4]):  # freed in no particular order
        alloc.free(alloc.page_slots(pages))
    assert alloc.alloc_pages(4) == [3, 4, 7, 20]
    assert alloc.alloc_pages(4) == [40, 41, 42, 63]
    assert alloc.alloc_pages(1) is None


##### ReqToTokenPool and KVPool #####


def test_req_slots_alloc_until_empty() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.table.shape == (3, 8) and pool.table.dtype == torch.int64
    assert [pool.alloc() for _ in range(3)] == [0, 1, 2]
    assert pool.available == 0
    assert pool.alloc() is None
    pool.free(1)
    assert pool.available == 1
    assert pool.alloc() == 1


@pytest.mark.parametrize("allocated_first", [True, False])
def test_req_slot_double_free_asserts(allocated_first: bool) -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    if allocated_first:
        row = pool.alloc()
        assert row is not None
        pool.free(row)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(0)
    assert pool.available == 2


def test_kv_pool_store_and_bytes_per_slot() -> None:
    pool = KVPool(8, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu")
    assert pool.k[0].shape == pool.v[1].shape == (8, 2, 4)
    loc = torch.tensor([3, 5])
    pool.store(1, loc, torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0))
    assert pool.k[1].dtype == torch.float16
    assert pool.k[1][loc].eq(1).all() and pool.v[1][loc].eq(2).all()
    assert pool.k[1].sum() == 16 and pool.k[0].abs().sum() == 0
    assert KVPool.bytes_per_slot(2, 2, 4, torch.float16) == 2 * 2 * 2 * 4 * 2


##### KVCacheManager: admit #####

BASE = list(range(100, 116))  # the cached prompt of the admit table is a prefix of this

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


##### KVCacheManager: cache_req #####


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_cache_req_keep_moves_own_slots_into_the_tree(page_size: int) -> None:
    cache = make_cache(page_size)
    req = make_req("r", list(range(2 * page_size + 2)))
    prefill(cache, req)
    slots, free = row_slots(cache, req), cache.allocator.free_slots
    cache.cache_req(req, release=False)
    done = aligned(req.kv_len, page_size)
    assert req.row is not None and req.kv_len == 2 * page_size + 2
    assert req.prefix_len == done
    assert row_slots(cache, req) == slots  # nobody had these tokens: the tree took ours
    assert cache.allocator.free_slots == free
    assert cache.tree.protected_size() == done and cache.tree.evictable_size() == 0
    assert cache.tree.match_prefix(req.input_ids).indices.tolist() == slots[:done]
    assert_accounted(cache, [req])
    forward(cache, req, 1)  # decode goes on after the cached part
    req.output_ids.append(8)
    assert_accounted(cache, [req])
    cache.cache_req(req, release=True)
    assert cache.tree.evictable_size() == aligned(2 * page_size + 3, page_size)
    cache.check_conservation()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("release", [False, True])
def test_duplicate_prompts_computed_concurrently_keep_one_copy(
    page_size: int, release: bool
) -> None:
    cache = make_cache(page_size)
    prompt = list(range(50, 50 + 2 * page_size + 1))
    a, b = make_req("a", prompt, arrival=1), make_req("b", prompt, arrival=2)
    assert cache.admit(a) and cache.admit(b)  # neither is cached yet
    prefill(cache, a)
    prefill(cache, b)
    a_slots, b_slots = row_slots(cache, a), row_slots(cache, b)
    assert not set(a_slots) & set(b_slots)
    done = aligned(len(prompt), page_size)
    free = cache.allocator.free_slots
    cache.cache_req(a, release=release)
    cache.cache_req(b, release=release)
    assert cache.tree.total_size() == done  # ONE copy
    assert cache.tree.match_prefix(prompt).indices.tolist() == a_slots[:done]
    if release:
        assert cache.allocator.free_slots == cache.allocator.total_slots - done
        cache.check_conservation()
        return
    assert cache.allocator.free_slots == free + done  # b's duplicate pages went back
    assert row_slots(cache, b) == a_slots[:done] + b_slots[done:]  # re-pointed, own tail kept
    assert a.prefix_len == b.prefix_len == done
    assert cache.tree.protected_size() == done
    assert_accounted(cache, [a, b])
    release_all(cache, [b, a])
    assert cache.tree.evictable_size() == done


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_logprob_capped_request_gives_back_its_recomputed_copies(page_size: int) -> None:
    p = page_size
    cache = make_cache(p)
    seed_tree(cache, BASE[:12])
    req = make_req("r", [*BASE[:12], 1], return_logprob=True, logprob_start_len=p + 1)
    assert cache.admit(req) and req.prefix_len == p  # 12 cached, but only p may be reused
    prefill(cache, req)
    free = cache.allocator.free_slots
    cache.cache_req(req, release=False)
    assert cache.allocator.free_slots == free + 12 - p  # [p, 12) was in the tree already
    done = aligned(13, p)
    assert cache.tree.total_size() == done
    assert row_slots(cache, req)[:done] == cache.tree.match_prefix(req.fill_ids).indices.tolist()
    assert_accounted(cache, [req])
    release_all(cache, [req])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_duplicate_behind_a_cached_request(page_size: int) -> None:
    """b was admitted before a cached its first chunk; b's later chunks dedupe against a's."""
    p = page_size
    cache = make_cache(p)
    prompt = list(range(60, 60 + 4 * p + 1))
    a, b = make_req("a", prompt), make_req("b", prompt)
    assert cache.admit(a) and cache.admit(b)
    for req in (a, b):
        forward(cache, req, 2 * p)
        cache.cache_req(req, release=False)
    assert cache.tree.total_size() == 2 * p
    for req in (a, b):
        forward(cache, req, req.extend_len)
        req.output_ids.append(1)
        cache.cache_req(req, release=False)
        assert_accounted(cache, [a, b])
    done = aligned(len(prompt), p)
    assert row_slots(cache, a)[:done] == row_slots(cache, b)[:done]
    assert cache.tree.total_size() == done
    release_all(cache, [a, b])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("tree", TREES)
def test_cache_req_release_frees_the_row_and_the_partial_tail(page_size: int, tree: str) -> None:
    cache = make_cache(page_size, tree=tree)
    req = make_req("r", list(range(2 * page_size + 1)))
    prefill(cache, req)
    cache.cache_req(req, release=True)
    assert (req.row, req.kv_len, req.prefix_len, req.last_node) == (None, 0, 0, None)
    assert cache.table.available == cache.table.max_reqs
    kept = aligned(2 * page_size + 1, page_size) if tree == "radix" else 0
    assert cache.tree.evictable_size() == kept
    assert cache.allocator.free_slots == cache.allocator.total_slots - kept
    cache.check_conservation()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_no_cache_keep_is_a_no_op(page_size: int) -> None:
    cache = make_cache(page_size, tree="none")
    req = make_req("r", list(range(2 * page_size + 1)))
    prefill(cache, req)
    slots, free = row_slots(cache, req), cache.allocator.free_slots
    cache.cache_req(req, release=False)
    assert row_slots(cache, req) == slots and req.prefix_len == 0
    assert cache.allocator.free_slots == free
    assert_accounted(cache, [req])
    release_all(cache, [req])


##### KVCacheManager: conservation #####


def leak_page(cache: KVCacheManager) -> None:
    assert cache.allocator.alloc_pages(1) is not None


def hold_row(cache: KVCacheManager) -> None:
    assert cache.table.alloc() is not None


def unreleased_request(cache: KVCacheManager) -> None:
    prefill(cache, make_req("r", [1, 2, 3, 4, 5]))


def locked_prefix(cache: KVCacheManager) -> None:
    seed_tree(cache, BASE[:8])
    assert cache.admit(make_req("r", BASE[:8] + [1]))  # locks 8 tokens, owns no slot


LEAKS: list[tuple[Callable[[KVCacheManager], None], str]] = [
    (leak_page, r"KV pool leak: free \d+ \+ evictable \d+ \+ protected 0 != total \d+"),
    (hold_row, r"request-slot leak: 1 of 4 rows"),
    (unreleased_request, r"KV pool leak"),
    (locked_prefix, r"protected 8 != total|protected must be 0"),
]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("leak", "message"), LEAKS, ids=[f.__name__ for f, _ in LEAKS])
def test_check_conservation_catches_leaks(
    page_size: int, leak: Callable[[KVCacheManager], None], message: str
) -> None:
    cache = make_cache(page_size)
    seed_tree(cache, [9] * 12)
    cache.check_conservation()
    leak(cache)
    with pytest.raises(RuntimeError, match=message):
        cache.check_conservation()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("tree", TREES)
def test_shared_prefix_lifecycle_is_conserved(page_size: int, tree: str) -> None:
    """Three requests over one system prompt: chunked prefill, decode, out-of-order finish."""
    p = page_size
    cache = make_cache(p, tree=tree)
    system = list(range(200, 200 + 3 * p))
    reqs = [make_req(f"r{i}", [*system, *range(10 * i, 10 * i + p + i)]) for i in range(3)]
    assert cache.admit(reqs[0])
    forward(cache, reqs[0], 2 * p)  # a first chunk
    cache.cache_req(reqs[0], release=False)
    assert_accounted(cache, reqs)
    prefill(cache, reqs[0], token=1)
    cache.cache_req(reqs[0], release=False)
    for req in reqs[1:]:
        assert cache.admit(req)
        assert req.prefix_len == (3 * p if tree == "radix" else 0)
        prefill(cache, req, token=2)
        cache.cache_req(req, release=False)
        assert_accounted(cache, reqs)
    for step in range(2 * p + 1):
        for req in reqs:
            forward(cache, req, 1)
            req.output_ids.append(step)
        assert_accounted(cache, reqs)
    for req in (reqs[1], reqs[0], reqs[2]):
        cache.cache_req(req, release=True)
        assert_accounted(cache, reqs)
    cache.check_conservation()
    if tree == "radix":
        again = make_req("again", reqs[2].fill_ids)
        assert cache.match_len(again) == aligned(again.seq_len - 1, p)
