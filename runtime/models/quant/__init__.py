"""weft.runtime.models.quant: quantized weights (GGUF blocks, FP8), chosen by the engine's
`quantization`; a registry of QuantConfig factories with lazy imports."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weft.runtime.models.quant.base import (
    QuantConfig,
    QuantEmbeddingMethod,
    QuantMethod,
    attach,
    quantized_layers,
    storage_parameter,
)


@dataclass(frozen=True)
class QuantContext:
    """What a QuantConfig factory may read: the model's HF config (its `quantization_config`,
    if any), the checkpoint (a .gguf file for gguf; the HF folder otherwise), the compute dtype,
    and whether the weights are random (load_format='dummy')."""

    hf_config: Any
    checkpoint: Path | None
    dtype: torch.dtype
    dummy: bool = False


# name -> "module:function", the function taking a QuantContext and returning a QuantConfig
_FACTORIES = {
    "gguf": "weft.runtime.models.quant.gguf:make_config",
    "fp8": "weft.runtime.models.quant.fp8:make_config",
}


def make_quant_config(name: str | None, ctx: QuantContext) -> QuantConfig | None:
    """The QuantConfig of `name` (EngineConfig.resolved_quantization), None for full precision."""
    if name is None:
        return None
    if name not in _FACTORIES:
        raise ValueError(f"quantization {name!r} is not supported (supported: "
                         f"{', '.join(sorted(_FACTORIES))})")  # fmt: skip
    module, func = _FACTORIES[name].split(":")
    config = getattr(importlib.import_module(module), func)(ctx)
    assert isinstance(config, QuantConfig), (name, type(config))
    return config


__all__ = [
    "QuantConfig",
    "QuantContext",
    "QuantEmbeddingMethod",
    "QuantMethod",
    "attach",
    "make_quant_config",
    "quantized_layers",
    "storage_parameter",
]
