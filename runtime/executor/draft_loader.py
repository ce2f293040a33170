"""Loading a speculative draft model: its file resolved and read as the target's would be (HF
folder, .gguf kept quantized through the quant hook, or random weights for load_format='dummy')."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from weft.runtime.config import EngineConfig
from weft.runtime.loader import gguf_path, iterate_weight_slices, read_hf_config, resolve_model_path
from weft.runtime.loader.fp8_checkpoint import refuse_quantized_checkpoint
from weft.runtime.loader.gguf_tensors import iterate_gguf
from weft.runtime.models import (
    LlamaForCausalLM,
    build_model,
    check_quantization,
    init_dummy_weights,
)
from weft.runtime.models.quant import QuantContext, make_quant_config

logger = logging.getLogger(__name__)

# the draft's dummy weights and its sampler's generator take seed + this: they differ from the
# target's (the same random stream in the draft's draws and the target's acceptance tests
# would correlate them)
DRAFT_SEED_OFFSET = 1


@dataclass(frozen=True)
class LoadedDraft:
    """A draft model with its weights on the device, and its HF config (load_draft)."""

    path: str
    model: LlamaForCausalLM
    hf_config: Any


def draft_config(config: EngineConfig, draft_path: str) -> EngineConfig:
    """The engine config with the draft as its model: the draft's file is then checked and its
    quantization resolved by the same rules as the target's (a .gguf kept quantized unless
    dequantize, fp8 at load, ...)."""
    try:
        return replace(config, model=draft_path)
    except ValueError as e:
        raise ValueError(f"speculative draft model {draft_path!r}: {e}") from e


def read_draft_hf_config(config: EngineConfig, draft_path: str) -> tuple[Path, Any]:
    """The draft's HF-format folder (a .gguf converted once into the cache; for dummy weights or
    kept GGUF blocks, its config and tokenizer only) and its HF config."""
    cfg = draft_config(config, draft_path)
    dummy = cfg.load_format == "dummy"
    try:
        folder = resolve_model_path(
            draft_path,
            cfg.resolved_cache_dir,
            need_weights=not dummy,
            gguf_weights=not dummy and cfg.resolved_quantization != "gguf",
        )
    except ValueError as e:
        raise ValueError(f"speculative draft model: {e}") from e
    return folder, read_hf_config(folder)


def load_draft(
    config: EngineConfig,
    draft_path: str,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> LoadedDraft:
    """The draft model with its weights on `device` in `dtype`. Refuses a draft whose context is
    shorter than the target's (`max_positions`, the table's width). Load it before sizing the
    target's KV pool on a GPU, so the pool's budget sees the draft's weights."""
    t0 = time.perf_counter()
    cfg = draft_config(config, draft_path)
    folder, hf_config = read_draft_hf_config(config, draft_path)
    draft_ctx = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if draft_ctx and draft_ctx < max_positions:
        raise ValueError(
            f"the draft model {draft_path!r} has max_position_embeddings {draft_ctx}, less than "
            f"the target's context of {max_positions} tokens; pass context_length <= {draft_ctx}"
        )
    dummy = cfg.load_format == "dummy"
    quant_name = cfg.resolved_quantization
    kept_gguf = quant_name == "gguf" and not dummy
    checkpoint = gguf_path(draft_path) if kept_gguf else folder
    check_quantization(hf_config, quant_name)
    if not dummy and quant_name is None:
        refuse_quantized_checkpoint(hf_config)
    quant = make_quant_config(quant_name, QuantContext(hf_config, checkpoint, dtype, dummy))
    model = build_model(hf_config, max_positions, device, dtype, None, quant)
    if dummy:
        init_dummy_weights(model, config.seed + DRAFT_SEED_OFFSET, quant=quant)
    elif kept_gguf:  # the blocks straight from the file
        model.load_weights(iterate_gguf(checkpoint, device=device))
    else:
        model.load_weights(iterate_weight_slices(folder, device=device))
    logger.info("draft model loaded in %.1f s", time.perf_counter() - t0)
    return LoadedDraft(draft_path, model, hf_config)
