"""Building blocks shared by our models: RMSNorm, rotary embedding (incl. Llama 3.1 scaling), SiLU-and-mul."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; `use_kernel`: weft's Triton kernel (CUDA) instead of torch ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from weft.kernels import rmsnorm

            shape = x.shape
            return rmsnorm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's next step. With the kernel
        both happen in one pass, in place in x and residual."""
        if self.use_kernel:
            from weft.kernels import fused_add_rmsnorm

            fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


def silu_and_mul(gate_up: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
    # gate_up: [T, 2 * I] -> [T, I]
    if use_kernel:
        from weft.kernels import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of a HF config, in transformers 5 (`rope_parameters`) or 4 style."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        scaling = getattr(config, "rope_scaling", None) or {}
        out = {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with linear or Llama 3.1 scaling."""
    base = float(params["rope_theta"])
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exps)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed float32 cos/sin cache, shared
    by every layer with the same settings on the same device. `use_kernel`: weft's Triton kernel
    rotates q and k in place (CUDA)."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.params = params
        self.use_kernel = False
        self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the caches, e.g. after the module was created on `meta`."""
        cos, sin, cos_sin = _rope_tables(self.head_dim, self.max_positions, self.params, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        if self.use_kernel:
            from weft.kernels import rotary_embedding

            rotary_embedding(positions, q, k, self.cos_sin)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


_ROPE_TABLES: weakref.WeakValueDictionary[tuple[object, ...], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


def _rope_tables(
    head_dim: int, max_positions: int, params: dict[str, Any], device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos [P, D], sin [P, D] (halves repeated) and the kernel's [cos | sin] [P, D], built once
    per (settings, device) while a model uses them: its layers share them (at a 128k context each
    table is 64 MB, so one copy per layer would cost gigabytes)."""
    dev = torch.device(device) if device is not None else torch.empty(0).device  # the default
    key = (head_dim, max_positions, repr(sorted(params.items())), str(dev))
    names = ("cos", "sin", "cos_sin")
    found = [_ROPE_TABLES.get(key + (n,)) for n in names]
    if all(t is not None for t in found):
        return found[0], found[1], found[2]  # type: ignore[return-value]
    inv_freq = rope_inv_freq(head_dim, params).to(dev)
    pos = torch.arange(max_positions, device=dev).float()
    freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    tables = (
        torch.cat((cos, cos), dim=-1),
        torch.cat((sin, sin), dim=-1),
        torch.cat((cos, sin), -1),
    )
    if dev.type != "meta":
        for name, table in zip(names, tables, strict=True):
            _ROPE_TABLES[key + (name,)] = table
    return tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
