"""weft.runtime.models: our torch modules, chosen by the checkpoint's architecture; dummy weights."""

from __future__ import annotations

from typing import Any

import torch

from weft.runtime.models.layers import RotaryEmbedding
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.models.parallel import TPInfo, check_tp
from weft.runtime.models.weights import dummy_weights

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
    config: Any,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPInfo | None = None,
) -> LlamaForCausalLM:
    """Create the model (this rank's shard of it) with uninitialised weights directly on `device`
    in `dtype`."""
    cls = model_class(config)
    tp = tp or TPInfo()
    check_tp(config, tp.size)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, tp)
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
def init_dummy_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights of the right shapes (benchmarks without real checkpoints): N(0, std), norms 1.

    Generated per checkpoint tensor and then sharded, so tp_size never changes the weights."""
    param = next(model.parameters())
    shapes = model.checkpoint_shapes()
    model.load_weights(dummy_weights(shapes, seed, param.device, param.dtype, std))


__all__ = [
    "LlamaForCausalLM",
    "TPInfo",
    "build_model",
    "init_dummy_weights",
    "model_class",
]
