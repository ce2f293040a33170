"""Scheduling policy on CPU: order_waiting, decode_reserve, PrefillAdder, retraction, decode batches.

No model runs: after a forward of n tokens `req.kv_len += n`, after sampling
`req.output_ids.append(tok)`. `MiniScheduler` at the end replays the scheduler's step (prefill
admission, chunking, retraction, decode) over a small pool and checks every slot it reads.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tests.unit.kv_helpers import PAGE_SIZES, make_req
from tests.unit.kv_helpers import make_cache as shared_make_cache
from weft.runtime.batch import Batch, ForwardMode
from weft.runtime.cache_manager import KVCacheManager
from weft.runtime.decode import build_decode_batch, retract_for_decode
from weft.runtime.prefill import (
    DECODE_RESERVE_CLIP,
    LPM_MAX_WAITING,
    PrefillAdder,
    decode_reserve,
    order_waiting,
)
from weft.runtime.request import Req

##### Helpers #####


def make_cache(
    page_size: int, num_pages: int = 32, tree: str = "radix", max_reqs: int = 8
) -> KVCacheManager:
    return shared_make_cache(page_size, num_pages, tree, max_reqs=max_reqs, max_context=128)


def make_adder(
    cache: KVCacheManager,
    token_budget: int = 64,
    chunk_size: int = 0,
    max_new_reqs: int = 8,
    reserved: int = 0,
    new_token_ratio: float = 0.0,
    idle: bool = True,
) -> PrefillAdder:
    return PrefillAdder(
        cache, token_budget, chunk_size, max_new_reqs, reserved, new_token_ratio, idle
    )


def seed_tree(cache: KVCacheManager, prompt: Sequence[int]) -> None:
    """A finished request that leaves `prompt` (its full pages) in the tree, unlocked."""
    req = make_req("seed", prompt)
    assert cache.admit(req)
    assert cache.alloc(req, req.extend_len)
    req.kv_len = req.seq_len
    cache.cache_req(req, release=True)


def run_extend(cache: KVCacheManager, batch: Batch, token: int = 7) -> None:
    """What the scheduler does after an extend forward: advance, sample when done, cache."""
    for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
        req.kv_len += n
        if req.kv_len == req.seq_len:
            req.output_ids.append(token)
        cache.cache_req(req, release=False)


def start_running(cache: KVCacheManager, prompts: Sequence[Sequence[int]]) -> list[Req]:
    """Requests (arrival 1, 2, ...) prefilled and sampled once: in the decode state."""
    reqs = [make_req(f"r{i}", p, arrival=i + 1) for i, p in enumerate(prompts)]
    for req in reqs:
        adder = make_adder(cache, token_budget=10_000)
        assert adder.add(req)
        batch = adder.batch()
        assert batch is not None
        run_extend(cache, batch)
    return reqs


def state(cache: KVCacheManager) -> tuple[int, ...]:
    """Everything a refused admission must leave as it was."""
    return (
        cache.allocator.free_slots,
        cache.tree.evictable_size(),
        cache.tree.protected_size(),
        cache.table.available,
    )


def assert_untouched(req: Req) -> None:
    assert (req.row, req.kv_len, req.prefix_len, req.last_node) == (None, 0, 0, None)


def run_and_release(cache: KVCacheManager, *adders: PrefillAdder) -> None:
    """Run the adders' batches (their allocated slots must be written before a release), then
    release every request and check conservation."""
    reqs: list[Req] = []
    for adder in adders:
        batch = adder.batch()
        if batch is not None:
            run_extend(cache, batch)
            reqs += batch.reqs
    release_all(cache, reqs)


def release_all(cache: KVCacheManager, reqs: Sequence[Req]) -> None:
    for req in reqs:
        if req.row is not None:
            cache.cache_req(req, release=True)
    cache.check_conservation()


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


##### decode_reserve #####


@pytest.mark.parametrize(
    ("max_new", "outputs", "ratio", "reserve"),
    [
        ([], [], 1.0, 0),
        ([10], [0], 1.0, 10),
        ([10, 20], [0, 0], 0.5, 15),
        ([10], [3], 1.0, 7),  # remaining, not max_new_tokens
        ([10], [10], 1.0, 0),
        ([10, 10], [0, 0], 0.0, 0),
        ([DECODE_RESERVE_CLIP + 1000], [0], 1.0, DECODE_RESERVE_CLIP),
        ([DECODE_RESERVE_CLIP + 1000, 10], [0, 0], 0.5, (DECODE_RESERVE_CLIP + 10) // 2),
    ],
)
def test_decode_reserve(max_new: list[int], outputs: list[int], ratio: float, reserve: int) -> None:
    reqs = [make_req(f"r{i}", [1], max_new_tokens=m) for i, m in enumerate(max_new)]
    for req, k in zip(reqs, outputs, strict=True):
        req.output_ids = [5] * k
    assert decode_reserve(reqs, ratio) == reserve


##### PrefillAdder: token budget, chunking, request slots #####


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_respects_the_token_budget(page_size: int) -> None:
    cache = make_cache(page_size)
    shared = list(range(50, 58))
    seed_tree(cache, shared)  # so the refused request locks a prefix while it is tried
    adder = make_adder(cache, token_budget=16, new_token_ratio=0.5)
    a, b = make_req("a", [1] * 6, max_new_tokens=4), make_req("b", [2] * 6, max_new_tokens=6)
    assert adder.add(a) and adder.add(b)
    assert (adder.extend_lens, adder.token_budget, adder.reserved) == ([6, 6], 4, 2 + 3)
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
        adder = make_adder(cache, chunk_size=chunk, new_token_ratio=1.0)
        assert adder.add(req)
        seen.append(adder.extend_lens[0])
        if adder.chunked is not None:
            assert adder.chunked is req
            assert not adder.add(other)  # a chunked request ends the batch
            assert_untouched(other)
        else:
            assert adder.reserved == 4
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

# pool: 8 pages; the request needs 3 pages; future = ceil(min(remaining, clip) * ratio);
# a reserve > 0 means requests are running (not idle)
MEMORY_CASES = [
    # (reserved in pages (+ extra tokens), max_new_tokens in pages (+ extra), ratio, admitted)
    ((5, 0), (1, 0), 0.0, True),  # 3 + 5 == 8
    ((5, 1), (1, 0), 0.0, False),  # one token over
    ((4, 0), (2, 0), 0.5, True),  # 3 + 4 + 1 == 8
    ((4, 0), (2, 2), 0.5, False),  # future 1 page + 1 token: over
    ((0, 1), (1, 0), 0.0, True),  # running requests: checked, fits
    ((0, 1), (100, 0), 1.0, False),  # running requests: the future reservation counts
    ((0, 0), (100, 0), 1.0, True),  # alone in an idle system: admitted
    ((9, 0), (1, 0), 0.0, False),
]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("reserved", "max_new", "ratio", "admitted"), MEMORY_CASES)
def test_adder_memory_check(
    page_size: int,
    reserved: tuple[int, int],
    max_new: tuple[int, int],
    ratio: float,
    admitted: bool,
) -> None:
    p = page_size
    cache = make_cache(p, num_pages=9)
    held = reserved[0] * p + reserved[1]
    adder = make_adder(
        cache, token_budget=1000, reserved=held, new_token_ratio=ratio, idle=held == 0
    )
    req = make_req("r", [1] * (3 * p), max_new_tokens=max_new[0] * p + max_new[1])
    before = state(cache)
    assert adder.add(req) is admitted
    if not admitted:
        assert_untouched(req)
        assert state(cache) == before and adder.reqs == []
    run_and_release(cache, adder)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_counts_evictable_as_available(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=9)
    seed_tree(cache, [5] * (6 * p))  # 6 pages evictable, 2 free
    adder = make_adder(cache, reserved=2 * p)
    req = make_req("r", [1] * (4 * p), max_new_tokens=1)
    assert adder.add(req)  # 4 + 2 reserved <= 2 free + 6 evictable: evicts inside alloc
    assert cache.tree.evictable_size() <= 4 * p
    assert not adder.add(make_req("s", [2] * (3 * p)))  # 3 + 2 > what is left
    run_and_release(cache, adder)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_adder_refusal_unlocks_the_matched_prefix(page_size: int) -> None:
    p = page_size
    cache = make_cache(p, num_pages=9)
    seed_tree(cache, [5] * (4 * p))
    adder = make_adder(cache, reserved=6 * p, idle=False)
    req = make_req("r", [5] * (4 * p) + [1] * (3 * p))
    before = state(cache)
    assert not adder.add(req)
    assert_untouched(req)
    assert state(cache) == before
    cache.check_conservation()


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
    # prompt 8 pages + decode reserve 4 pages (8 * 0.5) + running requests' 4 pages > 12 pages
    req = make_req("c", [1] * (8 * p), max_new_tokens=8 * p)

    def adder() -> PrefillAdder:
        return make_adder(cache, chunk_size=4 * p, reserved=4 * p, new_token_ratio=0.5)

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
    reserved = decode_reserve(running, 0.1)  # as the scheduler computes it
    adder = make_adder(cache, reserved=reserved, new_token_ratio=0.1, idle=False)
    req = make_req("new", [2] * (6 * p), max_new_tokens=20 * p)  # its reserve: 2 pages
    assert not adder.add(req), "6 pages free: the prompt fits, with its own reserve it does not"


##### MiniScheduler: the scheduler's step, replayed #####


class MiniScheduler:
    """Scheduler.schedule + process_results without a model. A forward writes, into each new KV
    slot, the token prefix its K/V would encode; every read slot is checked against it, so a slot
    that is shared wrongly, reused while live, or never written shows up as a mismatch."""

    def __init__(self, cache: KVCacheManager, policy: str, chunk: int, budget: int) -> None:
        self.cache, self.policy, self.chunk, self.budget = cache, policy, chunk, budget
        # 0.1: the floor the scheduler's new_token_ratio decays to (optimistic: retractions)
        self.max_running, self.ratio = 4, 0.1
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.done: list[Req] = []
        self.kv: dict[int, tuple[int, ...]] = {}
        self.retractions = self.chunks = 0

    def step(self) -> bool:
        batch = self.schedule()
        if batch is None:
            return False
        self.forward(batch)
        self.process(batch)
        holders = self.running + ([self.chunked] if self.chunked else [])
        self.check_accounting(holders)
        return True

    def schedule(self) -> Batch | None:
        batch = self.schedule_prefill()
        if batch is not None or not self.running:
            return batch
        retracted = retract_for_decode(self.running, self.cache)
        self.retractions += len(retracted)
        self.running = [r for r in self.running if r not in retracted]
        self.waiting += retracted
        return build_decode_batch(self.running, self.cache)

    def schedule_prefill(self) -> Batch | None:
        if not self.waiting and self.chunked is None:
            return None
        adder = PrefillAdder(
            self.cache,
            token_budget=self.budget,
            chunk_size=self.chunk,
            max_new_reqs=self.max_running - len(self.running),
            reserved=decode_reserve(self.running, self.ratio),
            new_token_ratio=self.ratio,
            idle=not self.running,
        )
        if self.chunked is not None:
            chunked, self.chunked = self.chunked, None
            if not adder.add(chunked):
                self.cache.cache_req(chunked, release=True)
                self.waiting.insert(0, chunked)
        if adder.chunked is None:
            for req in order_waiting(self.waiting, self.policy, self.cache):
                if not adder.add(req):
                    break
        batch = adder.batch()
        if batch is None:
            return None
        self.waiting = [r for r in self.waiting if r not in batch.reqs]
        self.chunked = adder.chunked
        self.chunks += adder.chunked is not None
        return batch

    def forward(self, batch: Batch) -> None:
        written: set[int] = set()
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
            assert req.row is not None
            row = self.cache.table.table[req.row].tolist()
            ids = tuple(req.fill_ids)
            for pos in range(req.kv_len):
                assert self.kv.get(row[pos]) == ids[: pos + 1], f"{req.rid}: bad KV at {pos}"
            for pos in range(req.kv_len, req.kv_len + n):
                slot = row[pos]
                assert slot >= self.cache.page_size, "wrote into the reserved page"
                assert slot not in written, "two tokens of one batch write one slot"
                written.add(slot)
                self.kv[slot] = ids[: pos + 1]

    def process(self, batch: Batch) -> None:
        still_running = []
        for req, n in zip(batch.reqs, batch.extend_lens, strict=True):
            req.kv_len += n
            extend = batch.mode == ForwardMode.EXTEND
            if extend and req.kv_len < req.seq_len:
                self.cache.cache_req(req, release=False)
                continue
            req.output_ids.append(next_token(req))
            if len(req.output_ids) == req.max_new_tokens:
                self.cache.cache_req(req, release=True)
                self.done.append(req)
                continue
            if extend:
                self.cache.cache_req(req, release=False)
            still_running.append(req)
        self.running = (
            still_running if batch.mode == ForwardMode.DECODE else self.running + still_running
        )

    def check_accounting(self, holders: Sequence[Req]) -> None:
        pages: set[int] = set()
        for req in holders:
            assert req.row is not None
            own = self.cache.table.table[req.row, req.prefix_len : req.kv_len]
            pages |= set((own // self.cache.page_size).tolist())
        tree = self.cache.tree
        total = (
            self.cache.allocator.free_slots
            + tree.evictable_size()
            + tree.protected_size()
            + len(pages) * self.cache.page_size
        )
        assert total == self.cache.allocator.total_slots
        tree.check_integrity()


def next_token(req: Req) -> int:
    """Deterministic 'sampling' from a tiny vocabulary, so outputs collide and get shared."""
    return 1 + (int(req.rid[1:]) + len(req.output_ids)) % 3


def make_workload(page_size: int, seed: int) -> list[Req]:
    rng = random.Random(seed)
    systems = [[], [1] * (3 * page_size + 1), [2, 3] * (2 * page_size)]
    reqs = []
    for i in range(24):
        prompt = rng.choice(systems) + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 12))]
        reqs.append(make_req(f"r{i}", prompt, max_new_tokens=rng.randrange(1, 14), arrival=i))
    return reqs


SCHEDULER_CASES = [
    (tree, policy, chunk)
    for tree in ("radix", "none")
    for policy, chunk in [("fcfs", 0), ("lpm", 0), ("fcfs", 8), ("lpm", 8)]
]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("tree", "policy", "chunk"), SCHEDULER_CASES)
def test_mini_scheduler_runs_a_workload_to_completion(
    page_size: int, tree: str, policy: str, chunk: int
) -> None:
    cache = make_cache(page_size, num_pages=48 // page_size + 1, tree=tree)
    sched = MiniScheduler(cache, policy, chunk, budget=16)
    workload = make_workload(page_size, seed=page_size)
    for req in workload:  # the engine's boundary check
        assert len(req.input_ids) + req.max_new_tokens <= cache.allocator.total_slots
    for step in range(300):  # healthy runs take < 150 steps
        if step % 3 == 0 and workload:
            sched.waiting += workload[:2]
            workload = workload[2:]
        if not sched.step() and not workload and not sched.waiting:
            break
    else:
        pytest.fail("the workload did not finish")
    assert len(sched.done) == 24
    assert all(len(r.output_ids) == r.max_new_tokens for r in sched.done)
    assert sched.retractions > 0, "the pool should be small enough to force retractions"
    if chunk:
        assert sched.chunks > 0
    cache.check_conservation()
