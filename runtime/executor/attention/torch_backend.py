"""The `torch` attention backend: gather each request's KV pages and call SDPA (the reference; CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    """Pads the batch to [B, max_q] queries over [B, max_kv] keys and masks what is not there.

    Padded keys point at the reserved slot 0 and padded queries read token 0; both are masked or
    dropped, so one SDPA call per layer serves a ragged batch of prefills or decodes.

    A hybrid sliding-window pool's windowed layers read and write at the SWA slots
    (`pool.slots_for`), mapped once per step; keys out of the window map to slot 0 (masked).
    """

    supports_hybrid_swa_pool = True

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        seq = batch.seq_lens  # [B]
        ext = batch.extend_lens  # [B]
        max_q = max(batch.extend_lens_cpu)
        max_kv = max(batch.seq_lens_cpu)
        q_off = torch.cumsum(ext, 0) - ext  # [B] first token row of each request

        qi = torch.arange(max_q, device=device)  # [max_q]
        q_valid = qi[None, :] < ext[:, None]  # [B, max_q]
        self.q_index = torch.where(q_valid, q_off[:, None] + qi[None, :], 0)  # [B, max_q]
        self.q_valid = q_valid

        kj = torch.arange(max_kv, device=device)  # [max_kv]
        kv_valid = kj[None, :] < seq[:, None]  # [B, max_kv]
        rows = self.req_to_token[batch.req_rows, :max_kv]  # [B, max_kv]
        self.kv_index = torch.where(kv_valid, rows, 0)
        # per layer kind (its slots_for differs): (store slots [T], key slots [B, max_kv])
        self._slots: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

        self.q_pos = (seq - ext)[:, None] + qi[
            None, :
        ]  # [B, max_q] absolute position of each query
        self.k_pos = kj
        causal = kj[None, None, :] <= self.q_pos[:, :, None]  # [B, max_q, max_kv]
        mask = causal & kv_valid[:, None, :]
        # padded query rows attend to key 0 only, so SDPA never sees an all-masked row
        self.mask = mask | (~q_valid[:, :, None] & (kj == 0)[None, None, :])
        self._window_masks: dict[int, torch.Tensor] = {}

    def _mask_for(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.mask
        if sliding_window not in self._window_masks:
            recent = self.k_pos[None, None, :] > self.q_pos[:, :, None] - sliding_window
            self._window_masks[sliding_window] = self.mask & (recent | ~self.q_valid[:, :, None])
        return self._window_masks[sliding_window]

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
        assert not kv_stored, "the torch backend does not lend its pool (lends_kv_pool)"
        loc, kv_index = self._slots_for(layer, batch)
        self.pool.store(layer, loc, k, v)
        qp = q[self.q_index].transpose(1, 2)  # [B, H, max_q, D]
        kp = self.pool.k[layer][kv_index].transpose(1, 2)  # [B, Hkv, max_kv, D]
        vp = self.pool.v[layer][kv_index].transpose(1, 2)
        if kp.dtype != qp.dtype:  # e.g. an fp8 pool, read back upcast
            kp, vp = kp.to(qp.dtype), vp.to(qp.dtype)
        out = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=self._mask_for(sliding_window)[:, None],
            scale=scale,
            enable_gqa=qp.shape[1] != kp.shape[1],
        )  # [B, H, max_q, D]
        return out.transpose(1, 2)[self.q_valid]  # [T, H, D]

    def _slots_for(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's store slots [T] and key slots [B, max_kv] (the pool's own for it)."""
        if not self.pool.hybrid:
            return batch.out_cache_loc, self.kv_index
        windowed = self.pool.is_windowed(layer)
        if windowed not in self._slots:
            self._slots[windowed] = (
                self.pool.slots_for(layer, batch.out_cache_loc),
                self.pool.slots_for(layer, self.kv_index),
            )
        return self._slots[windowed]
