"""The `flashinfer` attention backend: FlashInfer's paged decode/prefill wrappers over our KV pool."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from weft.kernels.common import FP8_KV
from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.executor.memory import KVPool
from weft.runtime.executor.transfer import to_device

WORKSPACE_BYTES = 256 * 1024 * 1024
HEAD_DIMS = (64, 128, 256)  # what FlashInfer's paged decode / prefill kernels are built for

PageLists = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # indptr (host), indices, last lens


class FlashInferAttentionBackend(AttentionBackend):
    """Decode steps use BatchDecodeWithPagedKVCacheWrapper (tensor cores for GQA); extend steps use
    BatchPrefillWithPagedKVCacheWrapper with a causal mask. The pool's per-layer buffers
    [slots, Hkv, D] are viewed as NHD pages [pages, page_size, Hkv, D]; a request's pages are read
    from its table row (position i lives in page row[i] // page_size, at offset i % page_size).

    CUDA graphs: one decode wrapper per captured batch size, on fixed page-list buffers; before
    each replay it is planned for the real batch (padded rows attend one token of the reserved
    page 0). Page lists are built on the device by `kernels.kv_page_indices` and the host parts
    come from the scheduler's lengths, so preparing a step never waits for the GPU.
    """

    supports_cuda_graph = True
    lends_kv_pool = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, page_size: int) -> None:
        super().__init__(pool, req_to_token)
        if pool.head_dim not in HEAD_DIMS:
            raise ValueError(
                f"attention backend 'flashinfer' takes head_dim {', '.join(map(str, HEAD_DIMS))}; "
                f"this model's is {pool.head_dim}: use attention_backend='triton'"
            )
        import flashinfer

        self._flashinfer = flashinfer
        self.page_size = page_size
        self.device = req_to_token.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode_tc = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        # NOTE: an fp8 pool under bf16 queries takes FlashInfer's fa2 kernels, which upcast the
        # pages as they load them (the decode wrapper's tensor-core path is fa2 already); fa3,
        # auto's pick on Hopper, runs fp8 attention with fp8 queries only
        fp8 = pool.k[0].dtype == FP8_KV
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2" if fp8 else "auto"
        )
        self._decode: Any = self.decode_tc  # the wrapper decode steps run (a graph's, in graphs)
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_indices: torch.Tensor | None = None  # shared by the graphs' wrappers
        self._lists: PageLists | None = None
        self._qo_indptr: torch.Tensor | None = None
        self._planned: tuple[float, int | None] | None = None
        self._batch: ForwardBatch | None = None
        self._plan_copied: torch.cuda.Event | None = None

    ##### Per step #####

    def prepare(self, batch: ForwardBatch) -> None:
        self._decode = self.decode_tc
        self._lists = self._page_lists(batch.req_rows, batch.seq_lens_cpu, batch.batch_size)
        self._qo_indptr = None
        if any(n != 1 for n in batch.extend_lens_cpu):  # extend steps only: decode plans lack it
            self._qo_indptr = _pinned(list(itertools.accumulate(batch.extend_lens_cpu, initial=0)))
        self._batch = batch
        self._planned = None

    def prepare_graph(self, batch: ForwardBatch, shared: bool = False) -> None:
        bs = batch.batch_size
        self._decode = self._graph_wrapper(bs)
        ones = [1] * bs  # every row: one token of the reserved page 0
        self._lists = (_pinned(list(range(bs + 1))), self._zeros(bs), _pinned(ones))
        self._batch = batch
        self._planned = None  # planned by the first warm-up run, before the capture

    def prepare_replay(self, batch: ForwardBatch, padded_size: int, shared: bool = False) -> None:
        assert self._planned is not None, "replay before any capture"
        self._decode = self._graph_wrapper(padded_size)
        self._lists = self._page_lists(batch.req_rows, batch.seq_lens_cpu, padded_size)
        self._batch = batch
        self._plan(*self._planned)

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
        if self._planned != (scale, sliding_window):
            self._q_dtype = q.dtype
            self._num_q_heads = q.shape[1]
            self._plan(scale, sliding_window)
        if not kv_stored:
            self.pool.store(layer, batch.out_cache_loc, k, v)
        shape = (-1, self.page_size, self.pool.num_kv_heads, self.pool.head_dim)
        cache = (self.pool.k[layer].view(shape), self.pool.v[layer].view(shape))
        if all(n == 1 for n in batch.extend_lens_cpu):
            out: torch.Tensor = self._decode.run(q.contiguous(), cache)
        else:
            out = self.prefill.run(q.contiguous(), cache)
        return out  # [T, H, D]

    ##### Internal Helper Functions #####

    def _page_lists(self, req_rows: torch.Tensor, seq_lens: list[int], padded: int) -> PageLists:
        """indptr and last-page lengths on the host (pinned), page indices on the device; rows
        past the batch (graph padding) get one token of page 0."""
        from weft.kernels.kv_indices import kv_page_indices

        p = self.page_size
        b = len(seq_lens)
        npages = [-(-s // p) for s in seq_lens] + [1] * (padded - b)
        last = [s - (n - 1) * p for s, n in zip(seq_lens, npages, strict=False)]
        last += [1] * (padded - b)
        indptr = list(itertools.accumulate(npages, initial=0))
        indices = self._zeros(indptr[-1])
        device_indptr = to_device(indptr[: b + 1], torch.int32, self.device)
        kv_page_indices(self.req_to_token, req_rows[:b], device_indptr, indices, p)
        return _pinned(indptr), indices, _pinned(last)

    def _plan(self, scale: float, window: int | None) -> None:
        batch, lists = self._batch, self._lists
        assert batch is not None and lists is not None
        indptr, indices, last = lists
        pool = self.pool
        window_left = -1 if window is None else window - 1
        # NOTE: plan() writes its schedule into a pinned buffer that a non-blocking copy sends
        # to the GPU; the previous plan's copy must have run before that buffer is rewritten
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        common: dict[str, Any] = {
            "window_left": window_left,
            "q_data_type": self._q_dtype,
            "kv_data_type": pool.k[0].dtype,
            "sm_scale": scale,
        }
        heads = (self._num_q_heads, pool.num_kv_heads, pool.head_dim, self.page_size)
        if all(n == 1 for n in batch.extend_lens_cpu):
            self._decode.plan(indptr, indices, last, *heads, **common)
        else:
            assert self._qo_indptr is not None
            self.prefill.plan(self._qo_indptr, indptr, indices, last, *heads, causal=True, **common)
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        self._planned = (scale, window)

    def _graph_wrapper(self, bs: int) -> Any:
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is not None:
            return wrapper
        pages_per_req = -(-self.req_to_token.shape[1] // self.page_size)
        if self._graph_indices is None:  # graphs are captured largest first: this one is
            self._graph_indices = self._zeros(bs * pages_per_req)
        assert self._graph_indices.numel() >= bs * pages_per_req, "capture the largest size first"
        wrapper = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=self._zeros(bs + 1),
            paged_kv_indices_buffer=self._graph_indices,
            paged_kv_last_page_len_buffer=self._zeros(bs),
        )
        self._graph_wrappers[bs] = wrapper
        return wrapper

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)


def _pinned(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, pin_memory=True)
