"""A model runner's KV memory: the paged pool (the hybrid sliding-window pool where the model mixes
windowed and global layers), sized by max_total_tokens or the memory budget, and its allocator."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import TPGroup
from weft.runtime.executor.memory import RESERVED_PAGES, KVPool, PageAllocator
from weft.runtime.executor.swa_memory import HybridKVPool, SWAPageAllocator, hybrid_page_counts
from weft.runtime.models.llama import LlamaDecoderLayer, head_dim_of

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 1 << 30  # default CPU budget for the KV pool


@dataclass(frozen=True)
class KVMemory:
    allocator: PageAllocator | SWAPageAllocator
    pool: KVPool
    swa_window: int | None  # the hybrid pool's window (the largest of the windowed layers)
    windowed: list[bool]  # per layer: whether it attends through a sliding window


def build_kv_memory(
    config: EngineConfig,
    model: Any,
    hf_config: Any,
    device: torch.device,
    context_len: int,
    tp: TPGroup | None,
    draft_bytes_per_slot: int | None,  # a draft model's KV per token (its pool is sized with it)
) -> KVMemory:
    """The pool and allocator for `model` (this rank's heads): the same size on every rank."""
    page_size = config.resolved_page_size
    first = model.layers[0]
    assert isinstance(first, LlamaDecoderLayer)
    kv_heads = first.self_attn.num_kv_heads  # this rank's
    head_dim = head_dim_of(hf_config)
    kv_dtype = config.kv_torch_dtype
    num_layers = hf_config.num_hidden_layers
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.layers]
    windowed = [w is not None for w in windows]
    swa_window = (  # the hybrid pool: windowed layers keep a window per request
        max(w for w in windows if w is not None)
        if any(windowed) and not all(windowed) and not config.disable_hybrid_swa_memory
        else None
    )
    if swa_window is None:
        per_slot = KVPool.bytes_per_slot(num_layers, kv_heads, head_dim, kv_dtype)
        per_slot += draft_bytes_per_slot or 0
        if config.max_total_tokens is not None:
            tokens = config.max_total_tokens
        else:
            tokens = kv_budget(config, device) // per_slot
        num_pages = -(-tokens // page_size) + RESERVED_PAGES
        if tp is not None:  # the same pool size on every rank: the accounting is replicated
            num_pages = tp.min_int(num_pages)
        # slot numbers live on the host (the scheduler's table mirror, the radix tree)
        allocator = PageAllocator(num_pages, page_size, "cpu")
        pool = KVPool(num_pages * page_size, num_layers, kv_heads, head_dim, kv_dtype, device)
        logger.info("KV pool: %d tokens in pages of %d", allocator.total_slots, page_size)
        return KVMemory(allocator, pool, None, windowed)
    if draft_bytes_per_slot is not None:  # (n-gram speculation needs no pool of its own)
        raise ValueError(
            "draft-model speculation does not run on the hybrid sliding-window KV pool yet (its "
            "own KV pool is not sized with it); pass disable_hybrid_swa_memory=True"
        )
    layer_bytes = KVPool.bytes_per_slot(1, kv_heads, head_dim, kv_dtype)
    num_pages, num_swa_pages = hybrid_page_counts(
        config, page_size, context_len, swa_window, windowed, layer_bytes,
        lambda: kv_budget(config, device),
    )  # fmt: skip
    if tp is not None:
        num_pages, num_swa_pages = tp.min_int(num_pages), tp.min_int(num_swa_pages)
    swa = SWAPageAllocator(num_pages, num_swa_pages, page_size, swa_window, device)
    hybrid = HybridKVPool(
        num_pages * page_size, num_swa_pages * page_size, windowed, kv_heads, head_dim, kv_dtype,
        device, swa,
    )  # fmt: skip
    logger.info(
        "KV pool (hybrid sliding window %d): %d full tokens for %d global layers, %d SWA tokens "
        "for %d windowed layers, in pages of %d", swa_window, swa.total_slots,
        windowed.count(False), swa.swa_total_slots, windowed.count(True), page_size,
    )  # fmt: skip
    return KVMemory(swa, hybrid, swa_window, windowed)


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV pool: mem_fraction of the GPU less what others use, or on CPU
    kv_cache_bytes (CPU_KV_BYTES by default)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free
        budget = int(total * config.mem_fraction) - used_by_others
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV pool with mem_fraction={config.mem_fraction}"
            )
        return budget
    return config.kv_cache_bytes or CPU_KV_BYTES
