"""KV memory: the paged token KV pool, its page allocator, and the request-to-token table."""

from __future__ import annotations

import heapq

import torch

from weft.kernels.common import (  # kv_cache_dtype="fp8_e4m3"; stores saturate at FP8_MAX
    FP8_KV,
    FP8_MAX,
)

# NOTE: page 0 is never handed out. Its slots are the write target of padded tokens and the gather
# target of padded keys, so kernels never need a bounds check.
RESERVED_PAGES = 1


class PageAllocator:
    """Free KV pages, handed out lowest first. Callers speak in token slots; a slot is
    page * page_size + offset.

    NOTE: lowest first keeps what is in use packed at the pool's low end however pages were
    freed (finished requests, radix-cache evictions), as SGLang's sorted free pages do: a
    request's pages stay close together, and a batch's KV spans few GPU memory pages."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str) -> None:
        if num_pages <= RESERVED_PAGES:
            raise ValueError(
                f"the KV pool needs more than {RESERVED_PAGES} page(s), got {num_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self._free = list(range(RESERVED_PAGES, num_pages))  # a min-heap (sorted is one)
        self._is_free = bytearray([0] * RESERVED_PAGES + [1] * (num_pages - RESERVED_PAGES))

    @property
    def total_slots(self) -> int:
        """Slots that can ever be handed out (the reserved page excluded)."""
        return (self.num_pages - RESERVED_PAGES) * self.page_size

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        """n whole pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free(self, slots: torch.Tensor) -> None:
        """Give back the pages holding these slots (callers pass whole pages' worth of slots)."""
        if slots.numel() == 0:
            return
        self.free_page_list(torch.unique(slots.to("cpu", torch.int64) // self.page_size).tolist())

    def free_page_list(self, pages: list[int]) -> None:
        """Give back these pages (each once)."""
        for p in pages:
            assert p >= RESERVED_PAGES, "freeing the reserved padding page"
            assert not self._is_free[p], f"KV page {p} freed twice"
            self._is_free[p] = 1
            heapq.heappush(self._free, p)

    def page_slots(self, pages: list[int]) -> torch.Tensor:
        """All slots of the given pages, in order: int64 [len(pages) * page_size]."""
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (base[:, None] + offs[None, :]).reshape(-1).to(self.device)


class KVPool:
    """K and V buffers per layer, indexed by token slot: [num_slots, num_kv_heads, head_dim].

    Backends address layer `layer` at `slots_for(layer, slots)`: the slots themselves here; the
    hybrid sliding-window pool (swa_memory.HybridKVPool) maps them for its windowed layers."""

    hybrid = False  # some layers' buffers are indexed by SWA slots (slots_for maps them)

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def is_windowed(self, layer: int) -> bool:
        """Whether the layer's buffers are indexed by SWA slots (never here)."""
        return False

    def slots_for(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Where layer `layer` keeps the tokens of these (full-pool) slots."""
        return slots

    def flush(self) -> None:
        """Send the host's slot-map writes to the device (nothing here: no map)."""

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T]; k, v: [T, Hkv, D]
        if self.k[layer].dtype == FP8_KV:  # saturate: e4m3fn has no inf, overflow would be NaN
            k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
        self.k[layer][loc] = k.to(self.k[layer].dtype)
        self.v[layer][loc] = v.to(self.v[layer].dtype)


class ReqToTokenPool:
    """Request slots: row r holds the KV slot of every token of the request in slot r.

    `table` is what the kernels read (on the model's device). The scheduler reads and writes
    `cpu`, a host mirror when the device is a GPU (the same tensor on CPU): reading a slot then
    costs no device sync, and `flush()` sends all writes since the last step in one copy.
    Every write must go through `write`.
    """

    def __init__(
        self,
        max_reqs: int,
        max_context: int,
        device: torch.device | str,
        mirror: bool | None = None,  # None: mirror unless the device is the CPU
    ) -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        if mirror is None:
            mirror = torch.device(device).type != "cpu"
        self.cpu = torch.zeros_like(self.table, device="cpu") if mirror else self.table
        self._dirty_rows: list[int] = []
        self._dirty_cols: list[int] = []
        self._free: list[int] = list(range(max_reqs - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert row not in self._free, f"request slot {row} freed twice"
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Row `row`, positions [start, start + len(slots)) <- slots (reaches `table` at flush)."""
        n = slots.numel()
        if n == 0:
            return
        self.cpu[row, start : start + n] = slots
        if self.cpu is not self.table:
            self._dirty_rows += [row] * n
            self._dirty_cols += range(start, start + n)

    def write_cells(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] <- slots[i] for each i (reaches `table` at flush)."""
        self.cpu[rows, cols] = slots
        if self.cpu is not self.table:
            self._dirty_rows += rows.tolist()
            self._dirty_cols += cols.tolist()

    def flush(self) -> None:
        """Copy the writes since the last flush to the device table: one transfer, one scatter."""
        if not self._dirty_rows:
            return
        rows = torch.tensor(self._dirty_rows, dtype=torch.int64)
        cols = torch.tensor(self._dirty_cols, dtype=torch.int64)
        packed = torch.stack((rows, cols, self.cpu[rows, cols]))  # [3, N]
        if self.table.is_cuda:  # pinned: the copy does not wait for the kernels queued before
            packed = packed.pin_memory()
        packed = packed.to(self.table.device, non_blocking=True)
        self.table[packed[0], packed[1]] = packed[2]
        self._dirty_rows, self._dirty_cols = [], []
