"""weft.runtime.executor.attention: attention backends behind one interface, chosen by name (lazy imports)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from weft.runtime.config import TuningConfig
from weft.runtime.executor.attention.base import AttentionBackend
from weft.runtime.executor.memory import KVPool

BackendFactory = Callable[[KVPool, torch.Tensor, int, TuningConfig], AttentionBackend]


def _torch_backend(
    pool: KVPool, req_to_token: torch.Tensor, page_size: int, tuning: TuningConfig
) -> AttentionBackend:
    from weft.runtime.executor.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(pool, req_to_token)


def _flashinfer_backend(
    pool: KVPool, req_to_token: torch.Tensor, page_size: int, tuning: TuningConfig
) -> AttentionBackend:
    from weft.runtime.executor.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(pool, req_to_token, page_size)


def _triton_backend(
    pool: KVPool, req_to_token: torch.Tensor, page_size: int, tuning: TuningConfig
) -> AttentionBackend:
    from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(pool, req_to_token, tuning.extend_work)


_REGISTRY: dict[str, BackendFactory] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
    "flashinfer": _flashinfer_backend,
}
_CUDA_ONLY = {"flashinfer", "triton"}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device: str) -> str:
    """`auto`: weft's Triton kernels on CUDA (on the H200 they measured as fast as FlashInfer's
    in CUDA graphs, see BENCHMARKS.md, and they take any head_dim), torch elsewhere."""
    if name == "auto":
        return "triton" if device == "cuda" else "torch"
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    if name in _CUDA_ONLY and device != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device")
    if name == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        raise ValueError(
            "attention backend 'flashinfer' is not installed (pip install 'weft[gpu]')"
        )
    return name


def create_attention_backend(
    name: str,
    device: str,
    pool: KVPool,
    req_to_token: torch.Tensor,
    page_size: int,
    tuning: TuningConfig | None = None,
) -> AttentionBackend:
    factory = _REGISTRY[resolve_backend_name(name, device)]
    return factory(pool, req_to_token, page_size, tuning or TuningConfig())


__all__ = [
    "AttentionBackend",
    "available_backends",
    "create_attention_backend",
    "resolve_backend_name",
]
