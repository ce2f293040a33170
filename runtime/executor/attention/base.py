"""AttentionBackend: the one interface through which models read and write the paged KV pool."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from weft.runtime.executor.batch import ForwardBatch
from weft.runtime.executor.memory import KVPool


class AttentionBackend(ABC):
    """Per step: `prepare(batch)` once, then `forward(...)` once per layer.

    `forward` stores the new tokens' K and V at `batch.out_cache_loc` in the pool, then attends each
    request's queries (its new tokens) over its whole KV (cached prefix + new tokens), causally.
    """

    supports_sliding_window = True  # per-layer windows (Mistral); checked when the engine starts
    supports_cuda_graph = False  # decode can be captured: implements prepare_graph
    # decode reads a prefix shared by several requests once per group (ForwardBatch.shared)
    supports_shared_prefix = False
    # the caller may store the new tokens' K/V itself (kv_store_target, forward's kv_stored)
    lends_kv_pool = False
    # reads a hybrid sliding-window pool (pool.hybrid): windowed layers at pool.slots_for(...)
    supports_hybrid_swa_pool = False

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.pool = pool
        self.req_to_token = req_to_token  # [max_reqs, max_context] int64
        self.shared_prefix = False  # the runner turns it on (before any capture) when supported

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Derive this step's metadata (indices, masks, plans) from the batch."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, H, D]
        """Store k/v for the new tokens (unless the caller did: `kv_stored`, into
        `kv_store_target`) and return attention output for q."""

    def rotates(self, batch: ForwardBatch) -> bool:
        """Whether `forward_rotating` serves this step (the triton backend's decode steps without
        shared prefixes): its kernel rotates q and k and stores k and v itself, which spares the
        caller's rotary launch."""
        return False

    def forward_rotating(
        self,
        q: torch.Tensor,  # [T, H, D] not rotated yet
        k: torch.Tensor,  # [T, Hkv, D] not rotated yet
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        batch: ForwardBatch,
        scale: float,
        cos_sin: torch.Tensor,  # [P, D] float32: cos then sin per position (cos_sin_cache)
        prefetch: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """forward for q and k that still need their rotary embedding at `batch.positions` (neox
        halves over whole heads), and k, v not yet stored; only where `rotates(batch)`.
        `prefetch`: what the caller reads next (its o_proj weight), which the backend may ask
        the L2 for while its kernel runs. `sliding_window`: the layer's, as `forward` takes it."""
        raise TypeError(f"{type(self).__name__} does not rotate q and k itself")

    def kv_store_target(
        self, layer: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_buffer, v_buffer, slots) of this layer's new tokens, for a caller that stores them
        itself in a kernel it runs anyway (the rotary kernel), or None: the backend stores
        them in forward (unless `lends_kv_pool`: the triton and FlashInfer backends)."""
        if not self.lends_kv_pool:
            return None
        return self.pool.k[layer], self.pool.v[layer], batch.out_cache_loc

    def graph_variants(self) -> tuple[bool, ...]:
        """Per captured batch size, a graph without (False) and, where the backend reads shared
        prefixes once per group, one with (True): a step whose plan has no group replays the
        graph that launches no shared-prefix kernel."""
        return (False, True) if self.shared_prefix else (False,)

    def prepare_graph(self, batch: ForwardBatch, shared: bool = False) -> None:
        """Metadata for capturing a decode step of `batch.batch_size` requests in a CUDA graph
        (`shared`: the variant that reads shared prefixes from static plan buffers): it may
        depend only on the batch size (the inputs are static buffers filled at replay)."""
        raise TypeError(f"{type(self).__name__} cannot run inside CUDA graphs")

    def prepare_replay(  # noqa: B027
        self, batch: ForwardBatch, padded_size: int, shared: bool = False
    ) -> None:
        """Before replaying the graph of `padded_size` (the `shared` variant or not) for the real
        decode `batch` (its tensors already copied into the graph's static buffers): update what
        the kernels read that is not a static buffer. Nothing, unless the backend plans per step."""
