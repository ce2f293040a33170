"""Shared-prefix plans of decode batches: groups from the radix tree, whose members' table rows
really hold the same slots over the planned prefix."""

from __future__ import annotations

import pytest
from kv_helpers import make_cache, make_req

from weft.runtime.executor.shared_prefix import SharedPrefixPlan, max_blocks, plan_shared_prefixes
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req


def prefilled(cache: KVCacheManager, rid: str, prompt: list[int]) -> Req:
    """A request after its prefill: KV for the whole prompt, its pages put in the tree."""
    req = make_req(rid, prompt)
    assert cache.admit(req)
    assert cache.alloc(req, req.seq_len - req.kv_len)
    req.kv_len = req.seq_len
    cache.cache_req(req, release=False)
    return req


def check_plan(
    cache: KVCacheManager, reqs: list[Req], plan: SharedPrefixPlan, limit: int | None = None
) -> None:
    """Every member's start is its block's length, its block's row holds the same slots there,
    and it is in exactly one block; non-members start at 0."""
    seen: dict[int, int] = {}
    for k, block in enumerate(plan.block_members):
        for b in block:
            if b >= 0:
                assert b not in seen, f"request {b} in two blocks"
                seen[b] = k
    table = cache.table.cpu
    for b, start in enumerate(plan.kv_starts):
        if start == 0:
            assert b not in seen
            continue
        k = seen[b]
        assert plan.block_lens[k] == start
        assert 0 < start < reqs[b].seq_len + 1
        row = reqs[b].row
        assert row is not None
        assert table[plan.block_rows[k], :start].tolist() == table[row, :start].tolist()
    assert plan.num_blocks <= (max_blocks(len(reqs)) if limit is None else limit)


def blocks_of(plan: SharedPrefixPlan) -> list[tuple[int, list[int]]]:
    """(prefix length, members) per block."""
    return sorted(
        (n, sorted(m for m in members if m >= 0))
        for members, n in zip(plan.block_members, plan.block_lens, strict=True)
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_groups_follow_the_deepest_node_two_requests_share(page_size: int) -> None:
    cache = make_cache(page_size, num_pages=400 // page_size, max_reqs=12, max_context=64)
    system = list(range(100, 108))  # shared by everyone
    doc_a, doc_b = list(range(200, 216)), list(range(300, 316))
    prompts = [
        system + doc_a + [1, 2, 3, 4, 5],
        system + doc_a + [6, 7, 8, 9, 10],
        system + doc_a + [11, 12, 13, 14, 15],
        system + doc_b + [16, 17, 18, 19, 20],
        system + doc_b + [21, 22, 23, 24, 25],
        system + [26, 27, 28, 29, 30, 31, 32, 33],  # shares only the system prompt
        list(range(500, 530)),  # shares nothing
    ]
    reqs = [prefilled(cache, f"r{i}", p) for i, p in enumerate(prompts)]
    plan = plan_shared_prefixes(reqs, min_tokens=1, block_limit=4)
    assert plan is not None
    check_plan(cache, reqs, plan, limit=4)
    aligned = (len(system) + 16) // page_size * page_size
    assert plan.kv_starts[:5] == [aligned] * 5
    assert plan.kv_starts[6] == 0
    # r5 shares the system prompt only with requests that have a deeper shared node: alone
    assert plan.kv_starts[5] == 0
    assert blocks_of(plan) == [(aligned, [0, 1, 2]), (aligned, [3, 4])]


def test_short_shared_prefixes_and_lone_requests_make_no_plan() -> None:
    cache = make_cache(1, num_pages=200, max_reqs=6, max_context=64)
    shared = list(range(100, 110))
    reqs = [prefilled(cache, f"r{i}", shared + [i, i + 1, i + 2]) for i in range(3)]
    assert plan_shared_prefixes(reqs, min_tokens=11) is None
    plan = plan_shared_prefixes(reqs, min_tokens=10)
    assert plan is not None and plan.kv_starts == [10, 10, 10]
    assert plan_shared_prefixes(reqs[:1], min_tokens=1) is None


def test_big_groups_are_cut_into_blocks_of_members() -> None:
    cache = make_cache(1, num_pages=400, max_reqs=12, max_context=64)
    shared = list(range(100, 120))
    reqs = [prefilled(cache, f"r{i}", shared + [i, 50 + i]) for i in range(11)]
    plan = plan_shared_prefixes(reqs, min_tokens=1, members_per_block=4, block_limit=3)
    assert plan is not None
    check_plan(cache, reqs, plan, limit=3)
    assert plan.block_members == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, -1]]
    assert plan.block_lens == [20, 20, 20]


def test_no_tree_path_no_plan() -> None:
    cache = make_cache(1, num_pages=200, tree="none", max_reqs=4, max_context=64)
    reqs = [prefilled(cache, f"r{i}", list(range(100, 130)) + [i]) for i in range(3)]
    assert plan_shared_prefixes(reqs, min_tokens=1) is None


def test_block_limit_keeps_the_groups_that_save_the_most_reads() -> None:
    cache = make_cache(1, num_pages=600, max_reqs=16, max_context=64)
    long_doc, short_doc = list(range(100, 140)), list(range(200, 212))
    reqs = [prefilled(cache, f"a{i}", long_doc + [i, 60 + i]) for i in range(3)]  # saves 2 x 40
    reqs += [prefilled(cache, f"b{i}", short_doc + [i, 70 + i]) for i in range(5)]  # 4 x 12
    plan = plan_shared_prefixes(reqs, min_tokens=1, block_limit=1)
    assert plan is not None
    check_plan(cache, reqs, plan, limit=1)
    assert plan.kv_starts == [40, 40, 40, 0, 0, 0, 0, 0]
    plan = plan_shared_prefixes(reqs, min_tokens=1, block_limit=2)
    assert plan is not None and plan.kv_starts == [40, 40, 40] + [12] * 5
    assert plan_shared_prefixes(reqs, min_tokens=1, block_limit=0) is None
    assert max_blocks(7) == 1 and max_blocks(256) == 32


def test_prefix_splits_aim_at_enough_programs() -> None:
    """Splits per prefix: about PREFIX_PROGRAMS programs over all blocks and kv heads, at most
    PREFIX_SPLITS, at least 256 tokens each, never 0."""
    from weft.runtime.executor.shared_prefix import PREFIX_PROGRAMS, PREFIX_SPLITS, prefix_splits

    assert PREFIX_PROGRAMS == 512 and PREFIX_SPLITS == 4
    assert prefix_splits(2048, 64, 8) == 1  # 64 groups: 512 programs in one split
    assert prefix_splits(2048, 32, 8) == 2
    assert prefix_splits(2048, 16, 8) == 4
    assert prefix_splits(2048, 4, 8) == 4  # few blocks: capped
    assert prefix_splits(600, 4, 8) == 2  # 256 tokens per split at least
    assert prefix_splits(100, 4, 8) == 1
    assert prefix_splits(2048, 0, 8) == 4


def test_plan_cache_reuses_a_plan_only_while_it_would_come_out_the_same() -> None:
    """A steady decode batch gets the cached plan; a node split on the requests' paths (another
    prompt's insert) leaves it right; another order, another member, a released request or a
    moved locked node make a new one. Each answer equals a fresh plan."""
    from weft.runtime.executor.shared_prefix import PlanCache

    cache = make_cache(1, num_pages=600, max_reqs=16, max_context=64)
    doc = list(range(100, 130))
    reqs = [prefilled(cache, f"r{i}", doc + [i, 60 + i]) for i in range(4)]
    plans = PlanCache()

    def check(batch: list[Req], hit: bool) -> None:
        hits = plans.hits
        got = plans.plan(batch)
        assert plans.hits == hits + hit
        assert got == plan_shared_prefixes(batch)
        if got is not None:
            check_plan(cache, batch, got)

    check(reqs, hit=False)
    for r in reqs:  # a decode step: tokens and KV grow, the plan does not change
        r.output_ids.append(7)
        assert cache.alloc(r, 1)
        r.kv_len += 1
    check(reqs, hit=True)
    first = plans.plan(reqs)
    # another prompt splits the shared node at 10 tokens: the cached plan is still right
    other = prefilled(cache, "split", doc[:10] + [900, 901, 902])
    assert plans.plan(reqs) is first
    check(reqs, hit=True)
    check(reqs[::-1], hit=False)
    check(reqs + [other], hit=False)
    check(reqs[:3], hit=False)
    # a request's locked node moves (its output cached): the key changes
    cache.cache_req(reqs[0], release=False)
    check(reqs[:3], hit=False)
    check(reqs[:3], hit=True)
    plans.clear()
    check(reqs[:3], hit=False)
