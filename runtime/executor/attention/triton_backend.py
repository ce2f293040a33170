"""The `triton` attention backend: weft's own paged decode (split-KV) and extend kernels."""

from __future__ import annotations

import torch

from weft.kernels.common import FP8_KV
from weft.kernels.decode import DecodePlan, DecodeRope, decode_attention
from weft.kernels.extend import extend_attention, extend_block_tokens, extend_work
from weft.kernels.kv_store import store_kv
from weft.kernels.l2 import L2Prefetch
from weft.kernels.shared_prefix import SharedPrefix
from weft.kernels.splits import decode_num_kv_splits
from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.executor.memory import KVPool
from weft.runtime.executor.shared_prefix import (
    MEMBERS_PER_BLOCK,
    SharedPrefixPlan,
    max_blocks,
    prefix_splits,
)
from weft.runtime.executor.swa_memory import HybridKVPool
from weft.runtime.executor.transfer import to_device

# Rotating decode steps of up to this many requests ask the L2 for the first half of the caller's
# next read (its o_proj weight) after their walk: their attention leaves HBM mostly idle. H200,
# batch 1-4: 0.015-0.025 ms less a step at half the weight, no gain at all of it
# (H200; `benchmarks/step.py decode --batches 1 2 4 8`)
L2_PREFETCH_MAX_BATCH = 4
L2_PREFETCH_FRACTION = 0.5


class TritonAttentionBackend(AttentionBackend):
    """Decode steps (one token per request) run the split-KV decode kernel; anything else runs
    the extend kernel (cached prefix from the pool, causal over the new tokens).

    Shared prefixes (`shared_prefix`, ForwardBatch.shared): a decode request in a group walks only
    its own KV after the group's prefix; one program per block of members reads the prefix once
    for all of them. In CUDA graphs the plan lives in static buffers sized for the largest batch,
    filled before each replay of the shared-prefix graph variant; a step without groups replays
    the plain variant, which reads no plan.

    Sliding windows (per layer): both kernels walk only each query's window. A windowed layer's
    decode does not use the shared-prefix grouping (each member's window starts at its own
    length) and splits its walk by a count fitted to min(window, context): a function of the
    batch size and the layer's window, fixed per captured graph as the plain count is.

    A hybrid sliding-window pool (pool.hybrid): a windowed layer's buffers are indexed by SWA
    slots, so its kernels take the pool's `full_to_swa` as a slot map (one more lookup per key:
    slot_map[req_to_token[row, j]]) and its new K/V go to the mapped slots (`_slots`). The map is
    a static device tensor that pool.flush() updates in place before each step, so a CUDA graph
    reads the step's map at replay; global layers launch the kernels without a map, as over a
    plain pool.
    """

    supports_sliding_window = True
    supports_cuda_graph = True
    supports_shared_prefix = True
    lends_kv_pool = True
    supports_hybrid_swa_pool = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, extend_work: str = "auto") -> None:
        super().__init__(pool, req_to_token)
        self.device = req_to_token.device
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.num_sms = props.multi_processor_count
            if pool.k[0].dtype == FP8_KV and (props.major, props.minor) < (8, 9):
                raise ValueError(
                    "kv_cache_dtype='fp8_e4m3' with attention_backend='triton' needs a GPU of "
                    f"compute capability 8.9 or newer (this one: {props.major}.{props.minor}); "
                    "use attention_backend='torch'"
                )
        else:  # TRITON_INTERPRET=1 (tests): the split heuristics only need a number
            self.num_sms = 4
        self.kv_starts: torch.Tensor | None = None
        self.shared: SharedPrefix | None = None
        # an extend step's query blocks (extend_work) instead of the full grid: auto on an fp8
        # pool, where it ran at 1.07-1.14x of the grid on the H200; over bf16 it ran at 0.68-0.79x
        # on batches of followers with a long cached prefix (H200; `benchmarks/kernel.py extend --work`)
        if extend_work not in ("auto", "on", "off"):
            raise ValueError(f"extend_work must be 'auto', 'on' or 'off', got {extend_work!r}")
        auto = pool.k[0].dtype == FP8_KV
        self.use_work = auto if extend_work == "auto" else extend_work == "on"
        self.work: torch.Tensor | None = None
        self._work_lens: tuple[list[int], list[int]] = ([], [])  # its extend and prefix lengths
        # CUDA graphs: kv_starts [N], block members [max_blocks(N), M], block rows, block lens
        self._static: tuple[torch.Tensor, ...] | None = None
        self._window_splits: dict[tuple[int, int], int] = {}  # (batch size, window) -> splits
        # [num_full_slots] int64: a hybrid pool's full slot -> SWA slot (windowed layers' rows)
        self.slot_map = pool.full_to_swa if isinstance(pool, HybridKVPool) else None
        # a windowed layer's new tokens' SWA slots [T], mapped at its first use in a step (see _slots)
        self._mapped_loc: tuple[torch.Tensor, bool] | None = None

    @property
    def _context(self) -> int:
        return self.req_to_token.shape[1]  # the longest possible context

    def _splits(self, batch_size: int, window: int | None = None) -> int:
        """Decode splits for a batch size. The longest possible context fixes the count (each
        split's length follows its request's at run time), so one graph serves every length, and
        eager steps use the kernel variants that graph capture compiled (NOTE: a split count met
        first mid-run costs a Triton compile, ~1 s, inside that step). A windowed layer walks at
        most `window` keys: the count for min(window, context)."""
        if window is not None:
            key = (batch_size, window)
            if key not in self._window_splits:
                self._window_splits[key] = self._count(batch_size, min(window, self._context))
            return self._window_splits[key]
        return self._count(batch_size, self._context)

    def _count(self, batch_size: int, keys: int) -> int:
        return decode_num_kv_splits(batch_size, self.pool.num_kv_heads, keys, self.num_sms,
                                    fp8=self.pool.k[0].dtype == FP8_KV)  # fmt: skip

    def prepare_graph(self, batch: ForwardBatch, shared: bool = False) -> None:
        self.decode = True
        self._mapped_loc = None
        bs = batch.batch_size
        self.num_kv_splits = self._splits(bs)
        self.kv_starts, self.shared = None, None
        if not shared:
            return
        assert self.shared_prefix, "a shared-prefix graph needs shared_prefix on"
        nb = max_blocks(bs)
        if self._static is None:  # graphs are captured largest first: this one is
            zeros = self._zeros
            self._static = (zeros(bs), zeros(nb, MEMBERS_PER_BLOCK), zeros(nb), zeros(nb))
        starts, members, rows, lens = self._static
        assert starts.numel() >= bs, "capture the largest size first"
        self.kv_starts = starts[:bs]
        splits = prefix_splits(self._context, nb, self.pool.num_kv_heads)
        self.shared = SharedPrefix(members[:nb], rows[:nb], lens[:nb], splits)

    def prepare_replay(self, batch: ForwardBatch, padded_size: int, shared: bool = False) -> None:
        if not shared:  # the graph without the shared-prefix kernel reads no plan buffer
            return
        assert self._static is not None and batch.shared is not None, "no shared-prefix graph"
        starts, members, rows, lens = self._static
        nb = max_blocks(padded_size)
        plan = batch.shared
        assert plan.num_blocks <= nb, (plan.num_blocks, nb)
        used = plan.num_blocks
        new_starts, new_members, new_rows, new_lens = self._upload(plan, padded_size, nb)
        starts[:padded_size].copy_(new_starts)
        members[:used].copy_(new_members)
        rows[:used].copy_(new_rows)
        lens[:nb].copy_(new_lens)

    def prepare(self, batch: ForwardBatch) -> None:
        self.decode = all(n == 1 for n in batch.extend_lens_cpu)
        self._mapped_loc = None
        self.kv_starts, self.shared = None, None
        if self.decode:
            if self.shared_prefix and batch.shared is not None:
                self.kv_starts, self.shared = self._eager_plan(batch.shared)
            self.num_kv_splits = self._splits(batch.batch_size)
        else:
            # NOTE: the 1-token requests at the end (a mixed batch's decodes) take the decode
            # kernel, which reads a kv head's keys once for its q heads (extend: once per q head)
            lens = batch.extend_lens_cpu
            p = len(lens)
            while p > 1 and lens[p - 1] == 1:
                p -= 1
            self.num_extend, self.extend_tokens = p, sum(lens[:p])
            if p < len(lens):
                self.num_kv_splits = self._splits(len(lens) - p)
                # NOTE: fresh copies, not views at an odd offset: Triton specializes a kernel on
                # its pointers' 16-byte alignment, so a view would compile new variants mid-run
                self.tail_rows = batch.req_rows[p:].clone()
                self.tail_lens = batch.seq_lens[p:].clone()
            ext = batch.extend_lens[:p]
            self.prefix_lens = batch.seq_lens[:p] - ext
            self.extend_start = torch.cumsum(ext, 0) - ext
            self.max_extend = max(lens[:p])
            self.work = None  # the query blocks to run (extend_work), built at the first layer
            if self.use_work:
                seq = batch.seq_lens_cpu[:p]
                self._work_lens = (lens[:p], [s - n for s, n in zip(seq, lens[:p], strict=True)])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        k_buf, v_buf = self.pool.k[layer], self.pool.v[layer]
        if not kv_stored:
            store_kv(k, v, k_buf, v_buf, self._slots(layer, batch))
        if self.decode:
            return self._decode(q, layer, batch, scale, window=sliding_window)
        slot_map = self._map(layer)
        out = torch.empty_like(q)
        p, t = self.num_extend, self.extend_tokens
        if self.work is None and self.use_work:
            group = q.shape[1] // k.shape[1]
            tokens = extend_block_tokens(q.dtype, k_buf.dtype, q.shape[2], group)
            items = extend_work(*self._work_lens, tokens)
            self.work = to_device(items, torch.int32, self.device).view(-1, 2)
        extend_attention(
            q[:t],
            k[:t],
            v[:t],
            k_buf,
            v_buf,
            self.req_to_token,
            batch.req_rows[:p],
            self.prefix_lens,
            batch.extend_lens[:p],
            self.extend_start,
            out[:t],
            scale,
            max_extend_len=self.max_extend,
            work=self.work,
            window=sliding_window,
            slot_map=slot_map,
        )
        if t < q.shape[0]:  # the decodes after them
            splits = self.num_kv_splits
            if sliding_window is not None:
                splits = self._splits(q.shape[0] - t, sliding_window)
            decode_attention(
                q[t:],
                k_buf,
                v_buf,
                self.req_to_token,
                self.tail_rows,
                self.tail_lens,
                out[t:],
                scale,
                DecodePlan(splits, window=sliding_window, slot_map=slot_map),
            )
        return out

    def kv_store_target(
        self, layer: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pool.k[layer], self.pool.v[layer], self._slots(layer, batch)

    def rotates(self, batch: ForwardBatch) -> bool:
        return self.decode and self.shared is None

    def forward_rotating(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        cos_sin: torch.Tensor,
        prefetch: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        assert self.rotates(batch), "forward_rotating serves only what rotates() accepts"
        rope = DecodeRope(batch.positions, cos_sin, k, v, batch.out_cache_loc)
        hint = None
        if prefetch is not None and batch.batch_size <= L2_PREFETCH_MAX_BATCH:
            hint = L2Prefetch(prefetch, L2_PREFETCH_FRACTION)
        return self._decode(q, layer, batch, scale, rope, hint, sliding_window)

    ##### Internal Helper Functions #####

    def _decode(
        self,
        q: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        rope: DecodeRope | None = None,
        hint: L2Prefetch | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """A decode step's attention (q and the new k rotated here too with `rope`); a windowed
        layer walks each request's window alone, without the shared-prefix grouping (and a
        hybrid pool's windowed layer through the slot map: `rope` stores at the mapped slot)."""
        slot_map = self._map(layer)
        if window is None and slot_map is None:
            plan = DecodePlan(self.num_kv_splits, shared=self.shared, kv_starts=self.kv_starts,
                              rope=rope, l2_prefetch=hint)  # fmt: skip
        else:
            splits = self.num_kv_splits
            if window is not None:
                splits = self._splits(batch.batch_size, window)
            plan = DecodePlan(splits, rope=rope, l2_prefetch=hint, window=window,
                              slot_map=slot_map)  # fmt: skip
        return decode_attention(q, self.pool.k[layer], self.pool.v[layer], self.req_to_token,
                                batch.req_rows, batch.seq_lens, torch.empty_like(q), scale,
                                plan)  # fmt: skip

    def _map(self, layer: int) -> torch.Tensor | None:
        """The slot map of this layer's buffers: the pool's full_to_swa for a windowed layer of
        a hybrid pool, else None (the kernels read req_to_token's slots directly)."""
        return self.slot_map if self.pool.is_windowed(layer) else None

    def _slots(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Where this layer stores the step's new tokens: out_cache_loc, or for a windowed layer
        of a hybrid pool slot_map[out_cache_loc], gathered once per step for all of them.

        NOTE: the gather runs on the device inside the forward, so a CUDA graph captures it and
        each replay maps the replayed out_cache_loc through the map as flushed for that step.
        A gather made outside a capture (the warm-up runs after prepare_graph) is never reused
        inside one, nor the captured one outside it: each side gathers again."""
        if self.slot_map is None or not self.pool.is_windowed(layer):
            return batch.out_cache_loc
        capturing = _capturing(self.device)
        if self._mapped_loc is None or self._mapped_loc[1] != capturing:
            self._mapped_loc = (self.pool.slots_for(layer, batch.out_cache_loc), capturing)
        return self._mapped_loc[0]

    def _eager_plan(self, plan: SharedPrefixPlan) -> tuple[torch.Tensor, SharedPrefix]:
        starts, members, rows, lens = self._upload(plan, len(plan.kv_starts), plan.num_blocks)
        splits = prefix_splits(max(plan.block_lens), plan.num_blocks, self.pool.num_kv_heads)
        return starts, SharedPrefix(members, rows, lens, splits)

    def _upload(
        self, plan: SharedPrefixPlan, n: int, nb: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plan on the device in one pinned copy: kv_starts [n] (zeros past the batch), block
        members [used, M], block rows [used], block lens [nb] (zeros past the used blocks)."""
        b, used = len(plan.kv_starts), plan.num_blocks
        flat = to_device(
            plan.kv_starts
            + [0] * (n - b)
            + [m for block in plan.block_members for m in block]
            + plan.block_rows
            + plan.block_lens
            + [0] * (nb - used),
            torch.int32,
            self.device,
        )
        cut = n + used * MEMBERS_PER_BLOCK
        members = flat[n:cut].view(used, MEMBERS_PER_BLOCK)
        return flat[:n], members, flat[cut : cut + used], flat[cut + used :]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.int32, device=self.device)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `device`."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
