"""weft.runtime.models: our torch modules, chosen by the checkpoint's architecture; dummy weights."""

from __future__ import annotations

from typing import Any

import torch

from weft.runtime.models import gemma3, llama, moe
from weft.runtime.models.family import ModelFamily, family_of, supported_architectures
from weft.runtime.models.layers import Projection, RotaryEmbedding
from weft.runtime.models.llama import LlamaForCausalLM
from weft.runtime.models.parallel import ParallelLMHead, TPInfo, VocabParallelEmbedding, check_tp
from weft.runtime.models.quant import QuantConfig, QuantEmbeddingMethod, attach
from weft.runtime.models.weights import dummy_weights

# every family weft serves; adding one is its module (declaring a ModelFamily) plus a line here
FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    moe.QWEN3_MOE_FAMILY,
    moe.MIXTRAL_FAMILY,
    gemma3.FAMILY,
)


def model_family(config: Any) -> ModelFamily:
    """The family serving this HF config; ValueError listing the supported architectures."""
    return family_of(config, FAMILIES)


def model_class(config: Any) -> type[LlamaForCausalLM]:
    cls = model_family(config).model_class
    assert issubclass(cls, LlamaForCausalLM), f"{cls.__name__} is not a LlamaForCausalLM"
    return cls


def architectures() -> dict[str, str]:
    """Every supported config.json architecture -> the name of the family serving it."""
    return supported_architectures(FAMILIES)


def check_quantization(config: Any, quantization: str | None) -> None:
    """ValueError naming the model and what it lacks when its family cannot load `quantization`
    (EngineConfig.resolved_quantization; None: full precision, always fine)."""
    family = model_family(config)
    if quantization is None or family.quantizable:
        return
    arch = (getattr(config, "architectures", None) or [config.model_type])[0]
    lacks = "quantized experts" if issubclass(family.model_class, moe.MoeForCausalLM) else "it"
    raise ValueError(
        f"{arch} ({family.name}) cannot load with quantization={quantization!r}: weft has no "
        f"{quantization} path for {lacks}; load it in full precision (bf16/fp16/fp32)"
    )


def build_model(
    config: Any,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPInfo | None = None,
    quant: QuantConfig | None = None,
) -> LlamaForCausalLM:
    """Create the model (this rank's shard of it) with uninitialised weights directly on `device`
    in `dtype`; with `quant`, the layers it names hold their method's storage instead (made on
    `meta` first like everything else, so no full-precision copy of them ever exists)."""
    check_quantization(config, quant.name if quant is not None else None)
    cls = model_class(config)
    tp = tp or TPInfo()
    check_tp(config, tp.size)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, tp)
            if quant is not None:
                _attach_quant(model, quant)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    if model.tie_word_embeddings:
        _tie(model.lm_head, model.embed_tokens)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(
    model: LlamaForCausalLM, seed: int, std: float = 0.02, quant: QuantConfig | None = None
) -> None:
    """Random weights of the right shapes (benchmarks without real checkpoints): N(0, std), norms 1
    (or where `quant` has a format of its own, its random tensors: QuantConfig.dummy_weight).

    Generated per checkpoint tensor and then sharded, so tp_size never changes the weights."""
    ref = model.norm.weight  # the model's device and dtype (a quantized layer's storage is not)
    shapes = model.checkpoint_shapes()
    model.load_weights(dummy_weights(shapes, seed, ref.device, ref.dtype, std, quant))


def _attach_quant(model: LlamaForCausalLM, quant: QuantConfig) -> None:
    """Give each layer `quant` names its method (the model still on meta)."""
    for prefix, module in model.named_modules():
        if isinstance(module, Projection):
            method = quant.method(prefix, module)
            if method is not None:
                attach(module, method, module.out_features, module.in_features)
        elif isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
            if isinstance(module, ParallelLMHead) and model.tie_word_embeddings:
                continue  # shares the embedding's (_tie)
            method = quant.method(prefix, module)
            if method is not None:
                if isinstance(module, VocabParallelEmbedding) and not isinstance(
                    method, QuantEmbeddingMethod
                ):
                    raise ValueError(f"{quant.name}: {type(method).__name__} cannot serve the "
                                     "vocab embedding (it has no embed)")  # fmt: skip
                rows, dim = module.weight.shape
                attach(module, method, rows, dim)
    if model.tie_word_embeddings:  # drop the lm_head's meta weight: only the storage is shared
        _tie(model.lm_head, model.embed_tokens)


def _tie(head: ParallelLMHead, embed: VocabParallelEmbedding) -> None:
    """The lm_head reads the embedding's matrix: its weight, or its quantized storage."""
    if embed.quant is None:
        head.weight = embed.weight
        return
    if "weight" in head._parameters:
        del head.weight  # the meta matrix LlamaForCausalLM tied before the embedding got blocks
    head.quant = embed.quant
    setattr(head, "weight_shape", getattr(embed, "weight_shape"))  # noqa: B009, B010
    for name, param in list(embed.named_parameters(recurse=False)):
        if hasattr(head, name):
            delattr(head, name)
        head.register_parameter(name, param)


__all__ = [
    "FAMILIES",
    "LlamaForCausalLM",
    "ModelFamily",
    "architectures",
    "TPInfo",
    "build_model",
    "check_quantization",
    "init_dummy_weights",
    "model_class",
    "model_family",
]
