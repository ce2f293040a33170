"""weft.kernels: Triton kernels and their PyTorch references (imports only torch and triton).

Each kernel module holds a @triton.jit kernel and a launch wrapper that checks shapes, dtypes and
strides; `reference` holds the float32 PyTorch semantics they are tested against. The names below
load lazily, so `weft.kernels.reference` works where triton is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._check import FP8_KV, FP8_MAX, supports_pdl
    from .activation import silu_and_mul
    from .argmax import argmax_rows
    from .bitmask import apply_token_bitmask
    from .decode import DecodeRope, decode_attention
    from .extend import extend_attention, extend_block_tokens, extend_work
    from .kv_indices import kv_page_indices
    from .kv_store import store_kv
    from .norm import fused_add_rmsnorm, rmsnorm
    from .rotary import cos_sin_cache, rotary_embedding
    from .shared_prefix import SharedPrefix
    from .skinny import AddNorm, GemvLaunch, NormedX, gemv, norm_tiles
    from .splits import decode_num_kv_splits

_EXPORTS = {
    "AddNorm": "skinny",
    "DecodeRope": "decode",
    "FP8_KV": "_check",
    "FP8_MAX": "_check",
    "GemvLaunch": "skinny",
    "NormedX": "skinny",
    "SharedPrefix": "shared_prefix",
    "apply_token_bitmask": "bitmask",
    "argmax_rows": "argmax",
    "cos_sin_cache": "rotary",
    "decode_attention": "decode",
    "decode_num_kv_splits": "splits",
    "extend_attention": "extend",
    "extend_block_tokens": "extend",
    "extend_work": "extend",
    "fused_add_rmsnorm": "norm",
    "gemv": "skinny",
    "kv_page_indices": "kv_indices",
    "norm_tiles": "skinny",
    "rmsnorm": "norm",
    "rotary_embedding": "rotary",
    "silu_and_mul": "activation",
    "store_kv": "kv_store",
    "supports_pdl": "_check",
}

__all__ = [
    "AddNorm",
    "DecodeRope",
    "FP8_KV",
    "FP8_MAX",
    "GemvLaunch",
    "NormedX",
    "SharedPrefix",
    "apply_token_bitmask",
    "argmax_rows",
    "cos_sin_cache",
    "decode_attention",
    "decode_num_kv_splits",
    "extend_attention",
    "extend_block_tokens",
    "extend_work",
    "fused_add_rmsnorm",
    "gemv",
    "kv_page_indices",
    "norm_tiles",
    "rmsnorm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
    "supports_pdl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
