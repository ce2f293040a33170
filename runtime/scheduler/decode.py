"""The decode set: the new tokens of every running request, retracting some when the KV pool is full,
or riding along in a prefill batch (mixed chunked prefill)."""

from __future__ import annotations

from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req


def pages_for_decode(reqs: list[Req], cache: KVCacheManager) -> int:
    return sum(cache.pages_needed(r, r.extend_len) for r in reqs)


def retract_for_decode(running: list[Req], cache: KVCacheManager) -> list[Req]:
    """Retract the newest requests until one decode step of the rest fits; returns the retracted.

    The oldest request is never retracted, and a single request always fits (the boundary caps
    prompt + max_new_tokens at the pool size), so the oldest always makes progress.
    """
    retracted: list[Req] = []
    by_age = sorted(running, key=lambda r: r.arrival)
    while len(by_age) > 1:
        need = pages_for_decode(by_age, cache) * cache.page_size
        if need <= cache.available_tokens:
            break
        victim = by_age.pop()
        cache.cache_req(victim, release=True)  # its KV stays in the tree, evictable
        victim.num_retractions += 1
        retracted.append(victim)
    return retracted


def build_decode_batch(running: list[Req], cache: KVCacheManager) -> Batch:
    """Slots for each running request's new tokens: its last sampled token, plus any tokens a
    grammar forced after it (jump-forward). Callers retract first, so this cannot fail."""
    lens = _alloc_next_tokens(running, cache)
    mode = ForwardMode.DECODE if all(n == 1 for n in lens) else ForwardMode.EXTEND
    return Batch(mode, list(running), lens)


def mix_decode(prefill: Batch, running: list[Req], cache: KVCacheManager) -> Batch:
    """`prefill` with the running requests' next tokens appended, after its own requests (so the
    attention backend finds the 1-token requests at the end), when their slots fit without
    retracting anyone; otherwise `prefill` alone (they decode in the next step, as unmixed)."""
    if not running or pages_for_decode(running, cache) * cache.page_size > cache.available_tokens:
        return prefill
    lens = _alloc_next_tokens(running, cache)
    return Batch(ForwardMode.EXTEND, prefill.reqs + running, prefill.extend_lens + lens)


def _alloc_next_tokens(running: list[Req], cache: KVCacheManager) -> list[int]:
    lens = [r.extend_len for r in running]
    if all(n == 1 for n in lens):
        ok = cache.alloc_decode(running)
    else:
        ok = all(cache.alloc(req, n) for req, n in zip(running, lens, strict=True))
    assert ok, "decode allocation failed after the pages were checked"
    return lens
