"""The `triton` attention backend: weft's own paged decode (split-KV) and extend kernels."""

from __future__ import annotations

import torch

from weft.kernels import decode_attention, extend_attention, store_kv
from weft.kernels.decode import decode_num_kv_splits
from weft.runtime.attention.base import AttentionBackend
from weft.runtime.batch import ForwardBatch
from weft.runtime.memory import KVPool


class TritonAttentionBackend(AttentionBackend):
    """Decode steps (one token per request) run the split-KV decode kernel; anything else runs
    the extend kernel (cached prefix from the pool, causal over the new tokens)."""

    supports_sliding_window = False
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(pool, req_to_token)
        props = torch.cuda.get_device_properties(req_to_token.device)
        self.num_sms = props.multi_processor_count

    def prepare_graph(self, batch: ForwardBatch) -> None:
        # the longest possible context fixes the split count, so one graph serves every length
        # (splits past a request's length are skipped by the kernel)
        self.decode = True
        self.num_kv_splits = decode_num_kv_splits(
            batch.batch_size, self.pool.num_kv_heads, self.req_to_token.shape[1], self.num_sms
        )

    def prepare(self, batch: ForwardBatch) -> None:
        self.decode = all(n == 1 for n in batch.extend_lens_cpu)
        if self.decode:
            self.num_kv_splits = decode_num_kv_splits(
                batch.batch_size, self.pool.num_kv_heads, max(batch.seq_lens_cpu), self.num_sms
            )
        else:
            ext = batch.extend_lens
            self.prefix_lens = batch.seq_lens - ext
            self.extend_start = torch.cumsum(ext, 0) - ext
            self.max_extend = max(batch.extend_lens_cpu)

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
        k_buf, v_buf = self.pool.k[layer], self.pool.v[layer]
        store_kv(k, v, k_buf, v_buf, batch.out_cache_loc)
        out = torch.empty_like(q)
        if self.decode:
            decode_attention(
                q,
                k_buf,
                v_buf,
                self.req_to_token,
                batch.req_rows,
                batch.seq_lens,
                out,
                scale,
                self.num_kv_splits,
            )
        else:
            extend_attention(
                q,
                k,
                v,
                k_buf,
                v_buf,
                self.req_to_token,
                batch.req_rows,
                self.prefix_lens,
                batch.extend_lens,
                self.extend_start,
                out,
                scale,
                max_extend_len=self.max_extend,
            )
        return out
