"""The `flashinfer` attention backend: FlashInfer's paged decode/prefill wrappers over our KV pool."""

from __future__ import annotations

import torch

from weft.runtime.attention.base import AttentionBackend
from weft.runtime.batch import ForwardBatch
from weft.runtime.memory import KVPool

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    """Decode steps use BatchDecodeWithPagedKVCacheWrapper (tensor cores for GQA); extend steps use
    BatchPrefillWithPagedKVCacheWrapper with a causal mask. The pool's per-layer buffers
    [slots, Hkv, D] are viewed as NHD pages [pages, page_size, Hkv, D]; a request's pages are read
    from its table row (position i lives in page row[i] // page_size, at offset i % page_size)."""

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, page_size: int) -> None:
        super().__init__(pool, req_to_token)
        import flashinfer

        self.page_size = page_size
        device = req_to_token.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_tc = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._planned: tuple[float, int | None] | None = None
        self._batch: ForwardBatch | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        p = self.page_size
        device = self.req_to_token.device
        npages = [-(-s // p) for s in batch.seq_lens_cpu]
        max_pages = max(npages)
        indptr = torch.tensor([0, *npages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        rows = self.req_to_token[batch.req_rows, : max_pages * p : p]  # [B, max_pages] first slots
        counts = torch.tensor(npages, device=device)
        have = torch.arange(max_pages, device=device)[None, :] < counts[:, None]  # [B, max_pages]
        self.kv_indices = (rows // p)[have].to(torch.int32)
        self.kv_indptr = indptr.to(device, non_blocking=True)
        last = [s - (n - 1) * p for s, n in zip(batch.seq_lens_cpu, npages, strict=True)]
        self.last_page_len = torch.tensor(last, dtype=torch.int32).to(device, non_blocking=True)
        qo = torch.tensor([0, *batch.extend_lens_cpu], dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )
        self.qo_indptr = qo.to(device, non_blocking=True)
        self._batch = batch
        self._planned = None

    def _plan(self, q: torch.Tensor, scale: float, window: int | None) -> None:
        batch = self._batch
        assert batch is not None
        pool = self.pool
        window_left = -1 if window is None else window - 1
        dtype = pool.k[0].dtype
        if all(n == 1 for n in batch.extend_lens_cpu):
            self.decode_tc.plan(
                self.kv_indptr,
                self.kv_indices,
                self.last_page_len,
                q.shape[1],
                pool.num_kv_heads,
                pool.head_dim,
                self.page_size,
                window_left=window_left,
                q_data_type=q.dtype,
                kv_data_type=dtype,
                sm_scale=scale,
            )
        else:
            self.prefill.plan(
                self.qo_indptr,
                self.kv_indptr,
                self.kv_indices,
                self.last_page_len,
                q.shape[1],
                pool.num_kv_heads,
                pool.head_dim,
                self.page_size,
                causal=True,
                sm_scale=scale,
                window_left=window_left,
                q_data_type=q.dtype,
                kv_data_type=dtype,
            )
        self._planned = (scale, window)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if self._planned != (scale, sliding_window):
            self._plan(q, scale, sliding_window)
        self.pool.store(layer, batch.out_cache_loc, k, v)
        shape = (-1, self.page_size, self.pool.num_kv_heads, self.pool.head_dim)
        cache = (self.pool.k[layer].view(shape), self.pool.v[layer].view(shape))
        if all(n == 1 for n in batch.extend_lens_cpu):
            out: torch.Tensor = self.decode_tc.run(q.contiguous(), cache)
        else:
            out = self.prefill.run(q.contiguous(), cache)
        return out  # [T, H, D]
