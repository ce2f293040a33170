"""Hybrid sliding-window KV memory: full pages paired with SWA pages, and the pool sized by both."""

from __future__ import annotations

from collections.abc import Callable

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.memory import RESERVED_PAGES, KVPool, PageAllocator


class SWAPageAllocator:
    """Full pages (the slot ids the table, the radix tree and out_cache_loc hold) each paired,
    while allocated, with a page of the smaller SWA pool, which holds the KV of the windowed
    layers. `full_to_swa` [num_full_slots] int64 maps a full slot to its SWA slot; 0 (the
    reserved padding page) where the SWA page was given back (`free_swa`: the tokens lie out of
    every future query's window) or never paired.

    `window`: the largest window of the windowed layers; a query at position p reads keys
    p - window + 1 .. p. The same interface as PageAllocator (alloc_pages, free, page_slots,
    total_slots, free_slots: those of the full pool), plus the SWA side.

    `full_to_swa` lives on the model's device; the host keeps `cpu` (the same tensor on a CPU
    device) and `flush()` sends the writes since the last step in one copy, as the
    request-to-token table does (stream-ordered after the step in flight)."""

    def __init__(
        self,
        num_pages: int,
        num_swa_pages: int,
        page_size: int,
        window: int,
        device: torch.device | str,
    ) -> None:
        self.full = PageAllocator(num_pages, page_size, "cpu")
        self.swa = PageAllocator(num_swa_pages, page_size, "cpu")
        self.page_size = page_size
        self.num_pages = num_pages
        self.window = window
        self.device = self.full.device  # slot numbers live on the host
        num_slots = num_pages * page_size
        self.full_to_swa = torch.zeros(num_slots, dtype=torch.int64, device=device)
        mirror = torch.device(device).type != "cpu"
        self.cpu = torch.zeros(num_slots, dtype=torch.int64) if mirror else self.full_to_swa
        self._page_map = [0] * num_pages  # full page -> SWA page (0: none)
        self._dirty: list[int] = []  # full pages whose map changed since the last flush
        self._offs = torch.arange(page_size, dtype=torch.int64)

    ##### The full pool (what callers of a PageAllocator see) #####

    @property
    def total_slots(self) -> int:
        return self.full.total_slots

    @property
    def free_slots(self) -> int:
        return self.full.free_slots

    @property
    def free_pages(self) -> int:
        return self.full.free_pages

    def alloc_pages(self, n: int) -> list[int] | None:
        """n full pages, each paired with a fresh SWA page; None (nothing taken) if either pool
        has fewer than n free."""
        if n > self.full.free_pages or n > self.swa.free_pages:
            return None
        pages = self.full.alloc_pages(n)
        swa = self.swa.alloc_pages(n)
        assert pages is not None and swa is not None
        for p, s in zip(pages, swa, strict=True):
            self._set(p, s)
        return pages

    def free(self, slots: torch.Tensor) -> None:
        """Give back the full pages holding these slots and the SWA pages still paired."""
        if slots.numel() == 0:
            return
        pages = self._pages(slots)
        self._release_swa(pages)
        self.full.free_page_list(pages)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        return self.full.page_slots(pages)

    ##### The SWA side #####

    @property
    def swa_total_slots(self) -> int:
        return self.swa.total_slots

    @property
    def swa_free_slots(self) -> int:
        return self.swa.free_slots

    @property
    def swa_free_pages(self) -> int:
        return self.swa.free_pages

    def free_swa(self, slots: torch.Tensor) -> int:
        """Give back the SWA pages paired with the full pages of these slots (the full pages
        stay allocated); returns how many were paired."""
        if slots.numel() == 0:
            return 0
        return self._release_swa(self._pages(slots))

    def swa_pages_of(self, pages: list[int]) -> list[int]:
        """The full pages among `pages` that still have their SWA page."""
        return [p for p in pages if self._page_map[p]]

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """bool [N]: whether each full slot's token still has its SWA KV."""
        return self.cpu[slots.to("cpu", torch.int64)] != 0

    def adopt_swa(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Where a page of `dst` (full slots, page-aligned) lacks its SWA page and the page at
        the same place in `src` (the same tokens' KV) has one, move it over: `src` is freed
        next, and `dst` (the radix tree's copy) keeps the SWA KV a request still reads."""
        p = self.page_size
        for d, s in zip(self._pages(dst[::p]), self._pages(src[::p]), strict=True):
            if not self._page_map[d] and self._page_map[s]:
                self._set(d, self._page_map[s])
                self._set(s, 0)

    def flush(self) -> None:
        """Copy the map writes since the last flush to the device: one transfer, one scatter."""
        if not self._dirty:
            return
        pages = torch.tensor(sorted(set(self._dirty)), dtype=torch.int64)
        self._dirty = []
        slots = (pages[:, None] * self.page_size + self._offs[None, :]).reshape(-1)
        packed = torch.stack((slots, self.cpu[slots]))  # [2, N]
        if self.full_to_swa.is_cuda:
            packed = packed.pin_memory()
        packed = packed.to(self.full_to_swa.device, non_blocking=True)
        self.full_to_swa[packed[0]] = packed[1]

    def check(self) -> None:
        """Every paired SWA page is allocated and paired once, every allocated SWA page is
        paired, and no free full page keeps one; RuntimeError with the numbers otherwise."""
        paired = [s for s in self._page_map if s]
        used = self.swa.num_pages - RESERVED_PAGES - self.swa.free_pages
        free_full = set(self.full._free)
        stale = [p for p in free_full if self._page_map[p]]
        if len(set(paired)) != len(paired) or len(paired) != used or stale:
            raise RuntimeError(
                f"SWA pool leak: {len(paired)} paired pages ({len(set(paired))} distinct), "
                f"{used} SWA pages in use, {len(stale)} free full pages still paired"
            )

    ##### Internal Helper Functions #####

    def _pages(self, slots: torch.Tensor) -> list[int]:
        pages: list[int] = torch.unique(slots.to("cpu", torch.int64) // self.page_size).tolist()
        return pages

    def _release_swa(self, pages: list[int]) -> int:
        swa = [self._page_map[p] for p in pages if self._page_map[p]]
        for p in pages:
            if self._page_map[p]:
                self._set(p, 0)
        self.swa.free_page_list(swa)
        return len(swa)

    def _set(self, page: int, swa_page: int) -> None:
        self._page_map[page] = swa_page
        ps = self.page_size
        self.cpu[page * ps : (page + 1) * ps] = swa_page * ps + self._offs if swa_page else 0
        if self.cpu is not self.full_to_swa:
            self._dirty.append(page)


class HybridKVPool(KVPool):
    """A KV pool whose windowed layers' buffers hold `num_swa_slots` tokens (SWA slots) and whose
    global layers' hold `num_slots` (full slots). `slots_for` maps full slots to a windowed
    layer's through the allocator's `full_to_swa`."""

    hybrid = True

    def __init__(
        self,
        num_slots: int,
        num_swa_slots: int,
        windowed: list[bool],  # per layer
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        allocator: SWAPageAllocator,
    ) -> None:
        self.num_slots = num_slots
        self.num_swa_slots = num_swa_slots
        self.num_layers = len(windowed)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.windowed = list(windowed)
        self.allocator = allocator
        self.full_to_swa = allocator.full_to_swa
        self.k, self.v = [], []
        for w in windowed:
            shape = (num_swa_slots if w else num_slots, num_kv_heads, head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    def is_windowed(self, layer: int) -> bool:
        return self.windowed[layer]

    def slots_for(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa[slots] if self.windowed[layer] else slots

    def flush(self) -> None:
        self.allocator.flush()


def hybrid_token_counts(
    budget_bytes: int, layer_bytes: int, num_global: int, num_windowed: int, ratio: float
) -> tuple[int, int]:
    """(full tokens, SWA tokens) that `budget_bytes` holds when a token costs `layer_bytes` per
    layer, with SWA tokens = ratio × full tokens: full × (global + ratio × windowed) bytes."""
    full = int(budget_bytes // (layer_bytes * (num_global + ratio * num_windowed)))
    return full, int(full * ratio)


def hybrid_page_counts(
    config: EngineConfig,
    page_size: int,
    context_len: int,
    window: int,
    windowed: list[bool],  # per layer
    layer_bytes: int,  # one token's K and V in one layer
    budget: Callable[[], int],  # the KV pool's bytes (asked only without max_total_tokens)
) -> tuple[int, int]:
    """(full pages, SWA pages) of the hybrid pool: SWA tokens = swa_full_tokens_ratio × full
    tokens within the budget (max_total_tokens: the full tokens), but at least one step's tokens
    plus a window (so the oldest request always makes progress), never more than full."""
    n_win, n_global = windowed.count(True), windowed.count(False)
    ratio = config.swa_full_tokens_ratio
    step = config.chunked_prefill_size and min(config.chunked_prefill_size,
                                               config.max_prefill_tokens)  # fmt: skip
    least = min(step or context_len, context_len) + window + 2 * page_size
    if config.max_total_tokens is not None:
        full = config.max_total_tokens
        swa = int(full * ratio)
    else:
        total = budget()
        full, swa = hybrid_token_counts(total, layer_bytes, n_global, n_win, ratio)
        if swa < min(least, full):  # the SWA pool's least, the rest of the budget full
            spare = total - least * n_win * layer_bytes
            full = max(spare // (n_global * layer_bytes), least)
    swa = min(max(swa, least), full)  # (never more SWA than full: each pairs with one)
    return -(-full // page_size) + RESERVED_PAGES, -(-swa // page_size) + RESERVED_PAGES
