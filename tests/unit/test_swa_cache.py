"""KVCacheManager over the hybrid sliding-window pool (window 4): a request keeps only its
window's SWA pages, the tree keeps the window at each insert, matches are cut to where the
window's SWA KV exists, evicting frees both pools, the tree's unread SWA pages are reclaimed
under pressure (not those a running request reads), a short SWA pool fails an allocation whole,
and conservation covers both pools (a leaked page raises)."""

from __future__ import annotations

import pytest
from kv_helpers import PAGE_SIZES, forward, make_req, prefill

from weft.radix import RadixCache
from weft.runtime.executor.memory import ReqToTokenPool
from weft.runtime.executor.swa_memory import SWAPageAllocator
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req

W = 4
PROMPT = list(range(100, 124))  # 24 tokens


def make_swa_cache(p: int, swa_slots: int = 32) -> KVCacheManager:
    """Room for 160 full slots and `swa_slots` SWA slots."""
    alloc = SWAPageAllocator(160 // p + 1, swa_slots // p + 1, p, W, "cpu")
    return KVCacheManager(alloc, RadixCache(alloc, p), ReqToTokenPool(4, 96, "cpu"))


def swa(cache: KVCacheManager) -> SWAPageAllocator:
    assert isinstance(cache.allocator, SWAPageAllocator)
    return cache.allocator


def swa_positions(cache: KVCacheManager, req: Req) -> list[int]:
    """Positions of the request's row whose SWA KV exists."""
    assert req.row is not None
    has = swa(cache).has_swa(cache.table.cpu[req.row, : req.kv_len])
    return [i for i, h in enumerate(has.tolist()) if h]


def window_start(kv_len: int, p: int) -> int:
    """The first position whose page a request at kv_len still holds."""
    return max(kv_len - W + 1, 0) // p * p


def finish(cache: KVCacheManager, req: Req) -> None:
    cache.cache_req(req, release=True)


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_decoding_request_keeps_only_its_window(p: int) -> None:
    cache = make_swa_cache(p)
    req = make_req("a", PROMPT, max_new_tokens=32)
    prefill(cache, req)
    cache.cache_req(req, release=False)  # its prompt into the tree: only the window keeps SWA
    assert swa_positions(cache, req) == list(range(window_start(24, p), 24))
    for t in range(20):
        assert cache.alloc_decode([req])
        req.kv_len += 1
        req.output_ids.append(t)
        own = [i for i in swa_positions(cache, req) if i >= req.prefix_len]
        assert own[0] >= window_start(req.kv_len - 1, p)  # freed before this step's alloc
        assert own == list(range(own[0], req.kv_len))
    finish(cache, req)
    cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_match_is_cut_to_where_the_window_has_swa_kv(p: int) -> None:
    cache = make_swa_cache(p)
    seed = make_req("seed", PROMPT[:8])
    prefill(cache, seed)
    cache.cache_req(seed, release=False)  # a chunk boundary at 8: SWA kept on [w0(8), 8)
    forward(cache, seed, 0)
    seed.input_ids = PROMPT[:16]
    forward(cache, seed, 8)
    finish(cache, seed)  # SWA on [w0(8), 8) and [w0(16), 16)
    # the whole prompt: usable (its window has SWA)
    assert cache.match_len(make_req("full", PROMPT[:16] + [1, 2, 3, 4])) == 16
    # 12 tokens shared: the window before 12 lost its SWA, before 8 it has it
    other = make_req("b", PROMPT[:12] + [7] * 8)
    assert cache.match_len(other) == 8
    assert cache.admit(other)
    assert other.prefix_len == other.kv_len == 8
    assert set(range(window_start(8, p), 8)) <= set(swa_positions(cache, other))
    forward(cache, other, other.extend_len)
    finish(cache, other)
    cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_eviction_frees_full_and_swa_pages(p: int) -> None:
    cache = make_swa_cache(p)
    req = make_req("a", PROMPT)
    prefill(cache, req)
    finish(cache, req)
    alloc = swa(cache)
    assert alloc.swa_free_slots < alloc.swa_total_slots
    cache.check_conservation()
    cache.tree.evict(10_000)
    assert (alloc.free_slots, alloc.swa_free_slots) == (alloc.total_slots, alloc.swa_total_slots)
    cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_swa_pressure_reclaims_the_trees_unread_swa_pages_not_a_running_window(p: int) -> None:
    cache = make_swa_cache(p, swa_slots=12)
    alloc = swa(cache)
    for i in range(3):  # three finished requests leave their windows in the tree
        req = make_req(f"s{i}", [i * 1000 + t for t in range(8)])
        prefill(cache, req)
        finish(cache, req)
    runner = make_req("run", [5000 + t for t in range(8)], max_new_tokens=32)
    prefill(cache, runner)  # (SWA short: the tree's windows are reclaimed, no node evicted)
    cache.cache_req(runner, release=False)
    assert cache.tree.total_size() == 4 * 8 // p * p
    kept = swa_positions(cache, runner)
    late = make_req("late", [9000 + t for t in range(8)])
    prefill(cache, late)  # reclaims again: the runner's window (in the tree, locked) stays
    assert swa_positions(cache, runner) == kept
    assert cache.tree.total_size() >= 4 * 8 // p * p
    for r in (runner, late):
        finish(cache, r)
    cache.check_conservation()
    assert alloc.free_slots + cache.tree.evictable_size() == alloc.total_slots


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_short_swa_pool_fails_the_allocation_whole(p: int) -> None:
    cache = make_swa_cache(p, swa_slots=8)
    alloc = swa(cache)
    a = make_req("a", PROMPT[:8])
    assert cache.admit(a)
    before = (alloc.free_slots, alloc.swa_free_slots)
    assert cache.alloc(a, 8)
    b = make_req("b", [1] * 8)
    assert cache.admit(b)
    before = (alloc.free_slots, alloc.swa_free_slots)
    assert not cache.alloc(b, 4)  # a holds every SWA page: nothing to reclaim
    assert (alloc.free_slots, alloc.swa_free_slots) == before
    assert not cache.swa_fits([b])
    a.kv_len = 8
    finish(cache, a)
    b.kv_len = 0
    assert cache.alloc(b, 4)  # a's window is the tree's now, unread: reclaimed
    b.kv_len = 4
    finish(cache, b)
    cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_conservation_catches_a_leaked_swa_page(p: int) -> None:
    cache = make_swa_cache(p)
    req = make_req("a", PROMPT)
    prefill(cache, req)
    finish(cache, req)
    cache.check_conservation()
    swa(cache).swa.alloc_pages(1)  # an SWA page nobody will give back
    with pytest.raises(RuntimeError, match="SWA"):
        cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_duplicate_gives_the_tree_copy_the_swa_kv_it_lacks(p: int) -> None:
    cache = make_swa_cache(p)
    a = make_req("a", PROMPT[:16], max_new_tokens=32)
    b = make_req("b", PROMPT[:16], max_new_tokens=32)
    prefill(cache, a)  # both compute the same 16 tokens (b admitted before a is cached)
    assert cache.admit(b) and b.prefix_len == 0
    forward(cache, b, 16)
    b.output_ids.append(7)
    for t in range(6):  # a moves on: its prompt's window goes out of a's own reach
        assert cache.alloc_decode([a])
        a.kv_len += 1
        a.output_ids.append(t)
    finish(cache, a)  # the tree: 16 + outputs, SWA only on a's last window
    cache.cache_req(b, release=False)  # b's copy is a duplicate: the tree's gets b's window
    assert b.prefix_len == 16
    assert set(range(window_start(17, p), 16)) <= set(swa_positions(cache, b))
    finish(cache, b)
    cache.check_conservation()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_decode_retracts_the_newest_when_the_swa_pool_is_short(p: int) -> None:
    from weft.runtime.scheduler.policy import retract_for_swa

    cache = make_swa_cache(p, swa_slots=8 + 2 * p)
    reqs = [make_req(f"r{i}", [i * 100 + t for t in range(4)], arrival=i) for i in range(3)]
    for req in reqs:
        prefill(cache, req)  # 4 tokens each, all in the window: 3 × 4 SWA slots don't fit
        if req is not reqs[-1]:
            cache.cache_req(req, release=False)
    assert not cache.swa_fits(reqs)
    gone = retract_for_swa(reqs, cache)
    assert reqs[0] not in gone and gone and gone[0] is reqs[-1]
    assert cache.swa_fits([r for r in reqs if r not in gone])
    for req in reqs:
        if req not in gone:
            finish(cache, req)
    cache.check_conservation()
