"""weft.runtime.attention: attention backends behind one interface, chosen by name (lazy imports)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from weft.runtime.attention.base import AttentionBackend
from weft.runtime.memory import KVPool

BackendFactory = Callable[[KVPool, torch.Tensor], AttentionBackend]


def _torch_backend(pool: KVPool, req_to_token: torch.Tensor) -> AttentionBackend:
    from weft.runtime.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(pool, req_to_token)


_REGISTRY: dict[str, BackendFactory] = {"torch": _torch_backend}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend_name(name: str, device: str) -> str:
    """`auto` picks the best backend registered for the device."""
    if name == "auto":
        return "torch"
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    return name


def create_attention_backend(
    name: str, device: str, pool: KVPool, req_to_token: torch.Tensor
) -> AttentionBackend:
    return _REGISTRY[resolve_backend_name(name, device)](pool, req_to_token)


__all__ = [
    "AttentionBackend",
    "available_backends",
    "create_attention_backend",
    "resolve_backend_name",
]
