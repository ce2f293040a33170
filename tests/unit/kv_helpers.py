"""Builders and checks shared by the memory, cache-manager, scheduling and attention unit tests:
requests, KV cache managers, a simulated model's forward, slot accounting, attention steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from weft.radix import NoCache, PrefixCache, RadixCache
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.memory import PageAllocator, ReqToTokenPool
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.request import Req

PAGE_SIZES = [1, 4]
BASE = list(range(100, 116))  # prompts of the cache-manager scenarios are prefixes of this


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


##### KVCacheManager scenario helpers #####


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


def step_batch(
    table: torch.Tensor,
    rows: Sequence[int],
    seq: Sequence[int],
    ext: list[int],
    order: list[int] | None = None,
    n: int = 0,
    shared: Any = None,
) -> ForwardBatch:
    """An attention step of requests `order` (default 0..len(ext)-1) of the request table:
    request b holds seq[b] tokens in table row rows[b] and runs its last ext[i] of them; padded
    to n rows (row 0, seq len 0, one token at slot 0). DECODE when every ext is 1."""
    order = order or list(range(len(ext)))
    n = max(n, len(ext))
    r = [rows[b] for b in order] + [0] * (n - len(ext))
    lens = [seq[b] for b in order] + [0] * (n - len(ext))
    ext = ext + [1] * (n - len(ext))
    positions = torch.cat([torch.arange(s - e, s) for s, e in zip(lens, ext, strict=True)])
    loc = torch.cat([table[row, max(s - e, 0) : s] for row, s, e in zip(r, lens, ext, strict=True)])
    loc = torch.cat([loc, torch.zeros(sum(ext) - loc.numel(), dtype=torch.int64)])
    return ForwardBatch(
        mode=ForwardMode.DECODE if max(ext) == 1 else ForwardMode.EXTEND,
        input_ids=torch.zeros(sum(ext), dtype=torch.int64),
        positions=positions.clamp(min=0),
        out_cache_loc=loc,
        req_rows=torch.tensor(r),
        seq_lens=torch.tensor(lens),
        extend_lens=torch.tensor(ext),
        seq_lens_cpu=lens,
        extend_lens_cpu=ext,
        shared=shared,
    )
