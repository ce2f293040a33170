"""Helpers of the scheduling unit tests (test_scheduling.py, test_decode_batch.py): a small cache,
a PrefillAdder with defaults, a simulated extend, running requests, state snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from kv_helpers import make_cache as shared_make_cache
from kv_helpers import make_req, release_all

from weft.runtime.executor.batch import Batch
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.admission import KVForecast
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.prefill import PrefillAdder
from weft.runtime.scheduler.request import Req


def make_cache(
    page_size: int, num_pages: int = 32, tree: str = "radix", max_reqs: int = 8
) -> KVCacheManager:
    return shared_make_cache(page_size, num_pages, tree, max_reqs=max_reqs, max_context=128)


def make_adder(
    cache: KVCacheManager,
    token_budget: int = 64,
    chunk_size: int = 0,
    max_new_reqs: int = 8,
    running: Sequence[Req] = (),
    ratio: float = 0.0,
    idle: bool = True,
    lag: int = 0,
) -> PrefillAdder:
    forecast = KVForecast(cache, ratio, lag, list(running))
    return PrefillAdder(cache, token_budget, chunk_size, max_new_reqs, forecast, idle)


def promised(tokens: int) -> Req:
    """A running request that holds no slots and will take `tokens` more (ignore_eos)."""
    return ignoring_eos(make_req(f"promised-{tokens}", [1]), tokens)


def ignoring_eos(req: Req, max_new_tokens: int) -> Req:
    """`req` with ignore_eos and this max_new_tokens: admission expects it to use them all."""
    req.params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    req.max_new_tokens = max_new_tokens
    return req


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
