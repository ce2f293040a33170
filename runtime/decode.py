"""The decode set: the new tokens of every running request, retracting some when the KV pool is full."""

from __future__ import annotations

from weft.runtime.batch import Batch, ForwardMode
from weft.runtime.cache_manager import KVCacheManager
from weft.runtime.request import Req


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
    lens = [r.extend_len for r in running]
    one_each = all(n == 1 for n in lens)
    if one_each:
        ok = cache.alloc_decode(running)
    else:
        ok = all(cache.alloc(req, n) for req, n in zip(running, lens, strict=True))
    assert ok, "decode allocation failed after retraction"
    mode = ForwardMode.DECODE if one_each else ForwardMode.EXTEND
    return Batch(mode, list(running), lens)
