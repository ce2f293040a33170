"""KVCacheManager on CPU (no model, simulated as in test_cache_manager.py): caching finished and
chunked requests into the radix tree, duplicates, and the conservation check."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kv_helpers import (
    BASE,
    PAGE_SIZES,
    aligned,
    assert_accounted,
    forward,
    make_cache,
    make_req,
    prefill,
    release_all,
    row_slots,
    seed_tree,
)

from weft.runtime.scheduler.cache_manager import KVCacheManager

TREES = ["radix", "none"]


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
