"""The sliding-window side of the KV cache: freeing out-of-window SWA pages, prefix matches cut to
where the window's SWA KV exists, SWA reclaim from the radix tree, and its conservation."""

from __future__ import annotations

import bisect

import torch

from weft.radix import PrefixCache
from weft.runtime.executor.memory import ReqToTokenPool
from weft.runtime.executor.swa_memory import SWAPageAllocator
from weft.runtime.scheduler.request import Req


class SWAWindows:
    """A query at position p reads the windowed layers' keys p - W + 1 .. p (W = the largest
    window), so a request whose next query is at kv_len no longer needs the SWA KV of positions
    before kv_len - W + 1:

        | prefix (tree) | own, SWA freed       | own, in the window |
        0               prefix_len             lo      kv_len-W+1   kv_len

    - a request gives back its own out-of-window SWA pages (`free_own`, before each allocation
      and before its KV goes into the tree); the radix tree then keeps full KV whose SWA part is
      gone (a "tombstone", as SGLang's SWA radix cache);
    - a cached prefix of length L is usable only if the SWA KV of positions L - W + 1 .. L - 1
      exists (`usable_len`);
    - when the SWA pool runs short, the tree's SWA pages that no running request's window
      reads go back, least recently used first (`reclaim`).

    NOTE: every future query of a request is at or after its kv_len at an allocation: a step
    starts at kv_len, and a verify step's rejected drafts roll kv_len back no further. A step
    still in flight (overlap) reads the old map and pages: the map's device copy and the next
    step's writes follow it on the stream."""

    def __init__(
        self, allocator: SWAPageAllocator, tree: PrefixCache, table: ReqToTokenPool
    ) -> None:
        self.allocator = allocator
        self.tree = tree
        self.table = table
        self.window = allocator.window
        self.page_size = allocator.page_size
        self.active: dict[int, Req] = {}  # table row -> request holding it
        self.lo = [0] * table.max_reqs  # per row: own SWA pages before this are given back
        self.reclaimed = 0  # tree SWA pages given back under pressure (a statistic)

    def admitted(self, req: Req) -> None:
        assert req.row is not None
        self.active[req.row] = req
        self.lo[req.row] = req.prefix_len

    def dropped(self, row: int) -> None:
        del self.active[row]

    def free_own(self, req: Req) -> None:
        """Give back the request's own SWA pages that lie wholly before kv_len - W + 1."""
        assert req.row is not None
        p = self.page_size
        hi = max(req.kv_len - self.window + 1, 0) // p * p
        lo = max(self.lo[req.row], req.prefix_len)
        if hi > lo:
            self.allocator.free_swa(self.table.cpu[req.row, lo:hi])
            self.lo[req.row] = hi

    def usable_len(self, slots: torch.Tensor) -> int:
        """The longest page-aligned L <= len(slots) whose window before it (positions
        max(0, L - W + 1) .. L - 1) still has its SWA KV."""
        missing = (~self.allocator.has_swa(slots)).nonzero().flatten().tolist()
        n, p = len(slots), self.page_size
        while n > 0:
            k = bisect.bisect_left(missing, n)  # missing positions before n
            if k == 0 or missing[k - 1] < n - self.window + 1:
                return n
            n = missing[k - 1] // p * p  # the page of the last missing position is cut off
        return 0

    def growth(self) -> int:
        """SWA pages the requests holding KV may still take, each up to a window's worth (the
        pages its window spans, its current page and the next)."""
        p = self.page_size
        cap = -(-(self.window - 1) // p) + 2
        total = 0
        for req in self.active.values():
            start = max(req.kv_len - self.window + 1, 0) // p * p
            held = -(-(req.kv_len - start) // p)
            longest = -(-(len(req.input_ids) + req.max_new_tokens) // p) + 1
            total += max(min(cap, longest) - held, 0)
        return total

    def make_room(self, pages: int) -> bool:
        """Whether `pages` SWA pages are free, reclaiming the tree's unread ones if needed."""
        short = pages - self.allocator.swa_free_pages
        if short > 0:
            self.reclaim(short)
        return pages <= self.allocator.swa_free_pages

    def reclaim(self, pages: int) -> int:
        """Give back up to `pages` SWA pages held by radix-tree nodes and read by no running
        request's window, least recently used nodes first; returns how many went back."""
        p, alloc = self.page_size, self.allocator
        kept: set[int] = set()  # full pages of tree prefixes inside a running request's window
        for req in self.active.values():
            assert req.row is not None
            start = max(req.kv_len - self.window + 1, 0) // p * p
            if start < req.prefix_len:
                kept.update((self.table.cpu[req.row, start : req.prefix_len : p] // p).tolist())
        freed = 0
        for value in self.tree.values_by_age():
            cand = [q for q in alloc.swa_pages_of((value[::p] // p).tolist()) if q not in kept]
            cand = cand[: pages - freed]
            if cand:
                freed += alloc.free_swa(torch.tensor(cand, dtype=torch.int64) * p)
            if freed >= pages:
                break
        self.reclaimed += freed
        return freed

    def tree_pages(self) -> int:
        """SWA pages paired with the tree's full pages."""
        p = self.page_size
        return sum(len(self.allocator.swa_pages_of((v[::p] // p).tolist()))
                   for v in self.tree.values_by_age())  # fmt: skip

    def check_conservation(self) -> None:
        """When idle (no request holds KV): SWA free + SWA pages of tree nodes == total."""
        self.allocator.check()
        p = self.page_size
        free, tree = self.allocator.swa_free_slots, self.tree_pages() * p
        total = self.allocator.swa_total_slots
        if free + tree != total or self.active:
            raise RuntimeError(
                f"SWA KV pool leak: free {free} + held by the tree {tree} != total {total} slots "
                f"({len(self.active)} request rows still active)"
            )
