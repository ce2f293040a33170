"""weft.runtime.models: our torch modules, chosen by the checkpoint's architecture; dummy weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weft.runtime.models.layers import RotaryEmbedding
from weft.runtime.models.llama import LlamaForCausalLM

# architecture name in config.json -> (model class, model_type values it covers)
_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def model_class(config: Any) -> type[LlamaForCausalLM]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _ARCHITECTURES:
            if config.model_type not in _MODEL_TYPES:
                break
            return _ARCHITECTURES[arch]
    if not archs and config.model_type in _MODEL_TYPES:
        return LlamaForCausalLM
    raise ValueError(
        f"unsupported model: architectures={archs}, model_type={config.model_type!r}; "
        f"supported: {', '.join(sorted(_ARCHITECTURES))}"
    )


def build_model(
    config: Any, max_positions: int, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """Create the model with uninitialised weights directly on `device` in `dtype`."""
    cls = model_class(config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights of the right shapes (benchmarks without real checkpoints): N(0, std), norms 1."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=gen)


__all__ = ["LlamaForCausalLM", "build_model", "init_dummy_weights", "model_class"]
