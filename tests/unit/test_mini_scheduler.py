"""The scheduler's step replayed on CPU without a model (MiniScheduler): prefill admission, chunking,
retraction and decode over a small pool, every KV slot read checked against what was written."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from kv_helpers import PAGE_SIZES, make_cache, make_req

from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler.admission import KVForecast
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.decode import build_decode_batch, retract_for_decode
from weft.runtime.scheduler.prefill import PrefillAdder, order_waiting
from weft.runtime.scheduler.request import Req

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
            forecast=KVForecast(self.cache, self.ratio, 0, self.running),
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
    cache = make_cache(page_size, 48 // page_size + 1, tree, max_reqs=8, max_context=128)
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
