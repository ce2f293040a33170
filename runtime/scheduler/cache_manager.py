"""KVCacheManager: a request's KV slots — prefix match, allocation with eviction, caching, release."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weft.radix import NoCache, PrefixCache
from weft.runtime.executor.memory import PageAllocator, ReqToTokenPool
from weft.runtime.executor.swa_memory import SWAPageAllocator
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.swa_cache import SWAWindows

if TYPE_CHECKING:
    from weft.runtime.executor.lora_step import LoraRuntime


class KVCacheManager:
    """Joins the page allocator, the prefix cache and the request-to-token table.

    Layout of a request's table row (P = page_size):

        | prefix_len (tree, locked) | own slots ... | partial last page |
        0                           prefix_len      kv_len//P*P          kv_len

    Own slots become the tree's when `cache_req` inserts them; duplicates (tokens another request
    put in the tree first) are freed and the row re-pointed at the tree's copy.

    With a hybrid sliding-window pool (SWAPageAllocator) `swa` keeps the SWA pages: only a
    window's worth per request, matches cut to where the window's SWA KV exists (SWAWindows).

    With LoRA adapters (`lora`) a request pins its adapter's pool slot while it holds its table
    row (admit .. _drop), and its tokens are keyed in the tree under its adapter's namespace.
    """

    def __init__(
        self,
        allocator: PageAllocator | SWAPageAllocator,
        tree: PrefixCache,
        table: ReqToTokenPool,
        lora: LoraRuntime | None = None,
    ) -> None:
        self.allocator = allocator
        self.lora = lora
        self.tree = tree
        self.table = table
        self.page_size = allocator.page_size
        self.swa = (
            SWAWindows(allocator, tree, table) if isinstance(allocator, SWAPageAllocator) else None
        )

    @property
    def available_tokens(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.allocator.free_slots + self.tree.evictable_size()

    def match_len(self, req: Req) -> int:
        """Cached prefix length the request would get (no side effects beyond LRU touch)."""
        indices = self.tree.match_prefix(self._key(req, self._match_cap(req))).indices
        return len(indices) if self.swa is None else self.swa.usable_len(indices)

    def lora_blocked(self, req: Req) -> bool:
        """Whether the request's LoRA adapter cannot get a pool slot now (all pinned by others)."""
        return req.lora_path is not None and not self._adapters().can_acquire(req.lora_path)

    def _adapters(self) -> LoraRuntime:
        assert self.lora is not None, "a LoRA request without LoRA adapters served"
        return self.lora

    def admit(self, req: Req) -> bool:
        """Give the request a table row, its LoRA adapter's slot (pinned) and its cached prefix
        (locked). False if no row (or adapter slot) is free."""
        if self.lora_blocked(req):
            return False
        row = self.table.alloc()
        if row is None:
            return False
        if req.lora_path is not None:
            self._adapters().acquire(req.lora_path)
        key = self._key(req, self._match_cap(req))
        match = self.tree.match_prefix(key)
        n = len(match.indices)
        usable = n if self.swa is None else self.swa.usable_len(match.indices)
        if usable < n:  # its window's SWA KV is gone: the shorter match, ending on a node
            n = usable
            match = self.tree.match_prefix(key[:n])
        self.table.write(row, 0, match.indices)
        self.tree.inc_lock_ref(match.last_node)
        req.row, req.kv_len, req.prefix_len, req.last_node = row, n, n, match.last_node
        req.draft_len = n  # a cached prefix's slots hold the draft model's KV too
        if self.swa is not None:
            self.swa.admitted(req)
        return True

    def pages_needed(self, req: Req, n: int) -> int:
        """New pages for n more tokens after kv_len (the partial last page is filled first)."""
        room = (-req.kv_len) % self.page_size
        return -(-max(n - room, 0) // self.page_size)

    def releasable(self, req: Req) -> int:
        """Slots that become obtainable (free or evictable) when `req` gives its KV up: its own,
        and the cached prefix nodes no other request locks."""
        n = req.kv_len - req.prefix_len
        node = req.last_node
        while node is not None and node.parent is not None and node.lock_ref == 1:
            n += len(node.key)
            node = node.parent
        return n

    def alloc(self, req: Req, n: int) -> bool:
        """KV slots for positions [kv_len, kv_len + n), evicting cached prefixes if needed."""
        if self.swa is not None:
            self.swa.free_own(req)
        got = self._take_pages(self.pages_needed(req, n))
        if got is None:
            return False
        assert req.row is not None
        room = min((-req.kv_len) % self.page_size, n)
        if room:  # the rest of the partly filled last page
            last = int(self.table.cpu[req.row, req.kv_len - 1])
            self.table.write(req.row, req.kv_len, torch.arange(last + 1, last + 1 + room))
        if got:
            fresh = self.allocator.page_slots(got)[: n - room]
            self.table.write(req.row, req.kv_len + room, fresh)
        return True

    def alloc_decode(self, reqs: list[Req]) -> bool:
        """`alloc(req, 1)` for every request, batched (a decode step's hot path): the slot after
        each request's last one, or a fresh page for those whose last page is full."""
        p = self.page_size
        if self.swa is not None:
            for req in reqs:
                self.swa.free_own(req)
        fresh = [i for i, r in enumerate(reqs) if r.kv_len % p == 0]
        pages = self._take_pages(len(fresh))
        if pages is None:
            return False
        rows = [r.row for r in reqs]
        cols = [r.kv_len for r in reqs]
        assert None not in rows, "decode of a request without a table row"
        rows_t = torch.tensor(rows, dtype=torch.int64)
        cols_t = torch.tensor(cols, dtype=torch.int64)
        slots = self.table.cpu[rows_t, (cols_t - 1).clamp_(min=0)] + 1  # the next slot, same page
        if fresh:
            slots[torch.tensor(fresh)] = torch.tensor(pages, dtype=torch.int64) * p
        self.table.write_cells(rows_t, cols_t, slots)
        return True

    def _take_pages(self, n: int) -> list[int] | None:
        """n free pages, evicting cached prefixes if needed; None (the cache kept) if even
        evicting everything evictable would not make room."""
        short = n * self.page_size - self.allocator.free_slots
        if short > self.tree.evictable_size():
            return None
        if short > 0:
            self.tree.evict(short)
        if self.swa is not None and not self.swa.make_room(n):
            return None
        return self.allocator.alloc_pages(n)

    def swa_fits(self, reqs: list[Req], extra: list[int] | None = None) -> bool:
        """Whether the SWA pool has the pages for these requests' next tokens (extend_len each,
        plus `extra` each: a verify step's drafts), after they give back their out-of-window
        ones (always, without a hybrid pool)."""
        if self.swa is None:
            return True
        for req in reqs:
            self.swa.free_own(req)
        more = extra or [0] * len(reqs)
        pages = sum(self.pages_needed(r, r.extend_len + e) for r, e in zip(reqs, more, strict=True))
        return self.swa.make_room(pages)

    def swa_admits(self) -> bool:
        """Whether the SWA pool has room for every request holding KV to grow to a window's
        worth of pages (always, without a hybrid pool)."""
        return self.swa is None or self.swa.make_room(self.swa.growth())

    def cache_req(self, req: Req, release: bool) -> None:
        """Put the request's computed KV into the tree; with `release`, give up all its slots."""
        assert req.row is not None
        row = self.table.cpu[req.row]
        kv_len = req.kv_len
        aligned = kv_len - kv_len % self.page_size
        key = self._key(req, kv_len)
        if self.swa is not None:  # the tree keeps only the window's SWA KV
            self.swa.free_own(req)
        values = row[:kv_len].clone()
        if isinstance(self.tree, NoCache):
            if release:
                self.allocator.free(values[req.prefix_len :])
                self._drop(req)
            return
        existing = self.tree.insert(key[:aligned], values[:aligned])
        if existing > req.prefix_len:
            if isinstance(self.allocator, SWAPageAllocator):  # SWA KV the tree's copy lacks
                cached = self.tree.match_prefix(key[:existing]).indices
                own = slice(req.prefix_len, existing)
                self.allocator.adopt_swa(cached[own], values[own])
            self.allocator.free(values[req.prefix_len : existing])
        if release:
            if aligned < kv_len:
                self.allocator.free(values[aligned:kv_len])
            self._drop(req)
            return
        match = self.tree.match_prefix(key[:aligned])
        n = len(match.indices)
        self.table.write(req.row, 0, match.indices)
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = match.last_node, n

    def _drop(self, req: Req) -> None:
        self.tree.dec_lock_ref(req.last_node)
        assert req.row is not None
        if req.grammar is not None:  # NOTE: before the slot (and its bitmask row) is handed on
            req.grammar.release()
        self.table.free(req.row)
        if req.lora_path is not None:
            self._adapters().release(req.lora_path)
        if self.swa is not None:
            self.swa.dropped(req.row)
        req.row, req.kv_len, req.prefix_len, req.last_node = None, 0, 0, None
        req.draft_len = 0

    def _key(self, req: Req, end: int) -> list[int]:
        """The tree key of the request's tokens [0, end): its adapter's namespace added to each
        id (the base model's are the ids), so two adapters never share KV."""
        tokens = req.tokens(0, end)
        if req.lora_path is None:
            return tokens
        ns = self._adapters().namespace(req.lora_path)
        return [t + ns for t in tokens]

    def _match_cap(self, req: Req) -> int:
        # the last token is always recomputed (its logits are needed); input logprobs from k need
        # the logits at k - 1, so the prefix may not reach past it
        cap = req.seq_len - 1
        if req.owes_input_logprobs:
            cap = min(cap, max(req.input_logprob_next - 1, 0))
        return cap

    def check_conservation(self) -> None:
        """When idle: free + evictable + protected == total slots, and no table row is held."""
        free = self.allocator.free_slots
        evictable = self.tree.evictable_size()
        protected = self.tree.protected_size()
        total = self.allocator.total_slots
        if free + evictable + protected != total or protected != 0:
            raise RuntimeError(
                f"KV pool leak: free {free} + evictable {evictable} + protected {protected} "
                f"!= total {total} slots (protected must be 0 when idle)"
            )
        if self.table.available != self.table.max_reqs:
            raise RuntimeError(
                f"request-slot leak: {self.table.max_reqs - self.table.available} of "
                f"{self.table.max_reqs} rows held while idle"
            )
        self.tree.check_integrity()
        if self.swa is not None:
            self.swa.check_conservation()
        if self.lora is not None:
            pinned = self.lora.pool.pinned()
            if pinned:
                raise RuntimeError(f"LoRA adapters pinned while idle: {pinned}")
            self.lora.pool.check_integrity()
