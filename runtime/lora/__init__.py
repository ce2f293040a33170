"""Multi-LoRA serving: PEFT adapters read into weft's fused layout, and their GPU slot pool."""

from weft.runtime.lora.adapter import LoraAdapter, LoraWeights, load_adapter, shard_adapter
from weft.runtime.lora.config import AdapterConfig, read_config
from weft.runtime.lora.pool import NO_LORA, LoraPool, LoraPoolFull, PoolWeights
from weft.runtime.lora.shapes import FUSED, TARGETS, LoraShapes

__all__ = [
    "FUSED",
    "NO_LORA",
    "TARGETS",
    "AdapterConfig",
    "LoraAdapter",
    "LoraPool",
    "LoraPoolFull",
    "LoraShapes",
    "LoraWeights",
    "PoolWeights",
    "load_adapter",
    "read_config",
    "shard_adapter",
]
