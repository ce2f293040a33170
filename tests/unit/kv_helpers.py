"""Builders shared by the memory and scheduling unit tests: requests and KV cache managers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weft.radix import NoCache, PrefixCache, RadixCache
from weft.runtime.cache_manager import KVCacheManager
from weft.runtime.memory import PageAllocator, ReqToTokenPool
from weft.runtime.request import Req
from weft.runtime.sampling_params import SamplingParams

PAGE_SIZES = [1, 4]


def make_req(
    rid: str, prompt: Sequence[int], max_new_tokens: int = 8, arrival: int = 0, **kwargs: Any
) -> Req:
    return Req(
        rid=rid,
        input_ids=list(prompt),
        params=SamplingParams(max_new_tokens=max_new_tokens),
        max_new_tokens=max_new_tokens,
        arrival=arrival,
        **kwargs,
    )


def make_cache(
    page_size: int,
    num_pages: int = 32,
    tree: str = "radix",
    max_reqs: int = 4,
    max_context: int = 64,
) -> KVCacheManager:
    allocator = PageAllocator(num_pages, page_size, "cpu")
    prefix_cache: PrefixCache = (
        RadixCache(allocator, page_size) if tree == "radix" else NoCache(allocator, page_size)
    )
    return KVCacheManager(allocator, prefix_cache, ReqToTokenPool(max_reqs, max_context, "cpu"))
