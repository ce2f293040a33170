"""Building blocks shared by our models: projections, RMSNorm (and Gemma's), rotary embedding (incl.
Llama 3.1 scaling), SiLU-and-mul, GELU-and-mul."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.kernels.host_linear import host_linear

if TYPE_CHECKING:
    from weft.kernels.skinny import GemvLaunch
    from weft.runtime.lora.forward import LoraSite
    from weft.runtime.models.quant.base import QuantMethod


Shape = tuple[int, int, bool]  # a projection's (out features, in features, gated)


@dataclass(frozen=True)
class GemvPlan:
    """Which projections of a forward run weft's skinny GEMV (CUDA), by weight shape, and with
    which launch: a few rows read the weight once near copy speed, where cuBLAS falls short. The
    decode graph runner times one per batch size before capture (runtime/executor/graph_tuning.py)
    and hands it in with the batch (ForwardBatch.gemv); without one, cuBLAS runs them all."""

    launches: Mapping[Shape, GemvLaunch]


class Projection(nn.Linear):
    """nn.Linear that runs weft's skinny GEMV where a GemvPlan names its shape. `gated`: the
    model calls it through forward_gated (a gated MLP's down projection). A quantized one
    carries a QuantMethod (`quant`, attached at build: runtime/models/quant/) that holds its
    weight and runs it; GemvPlans never name it. Where LoRA adapters are served, `lora` adds
    the delta of each token's adapter to the output (before any all-reduce)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gated: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gated = gated
        self.pdl = False  # the GEMV launches as a programmatic dependent (use_kernels)
        self.quant: QuantMethod | None = None
        self.lora: LoraSite | None = None  # set where LoRA adapters are served (lora/forward.py)

    @property
    def shape(self) -> Shape:
        return (self.out_features, self.in_features, self.gated)

    @property
    def prefetch_tensor(self) -> torch.Tensor:
        """The weight's bytes a kernel before this one may pull into the L2."""
        return self.weight if self.quant is None else self.quant.main_tensor(self)

    def use_kernels(self, pdl: bool) -> None:
        self.pdl = pdl

    def forward(self, x: torch.Tensor, gemv: GemvPlan | None = None) -> torch.Tensor:
        y = self._project(x, gemv)
        return y if self.lora is None else self.lora.add(x, y)

    def _project(self, x: torch.Tensor, gemv: GemvPlan | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, self.bias)
        launch = gemv.launches.get(self.shape) if gemv is not None else None
        if launch is not None:
            from weft.kernels.skinny import gemv as skinny_gemv

            return skinny_gemv(x, self.weight, self.bias, launch=launch, pdl=self.pdl)
        return host_linear(x, self.weight, self.bias)

    def forward_gated(
        self,
        gate_up: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        gemv: GemvPlan | None = None,
    ) -> torch.Tensor:
        """self(act(gate_up)) for act = SiLU-and-mul; where the GEMV runs, the activation is
        computed inside it (as silu_and_mul's kernel rounds it), saving its launch. With LoRA
        tokens in the batch the activation is computed once, for the base and the delta (the
        GEMV, where its plan names this shape, then reads it as a plain input)."""
        if self.lora is not None and self.lora.active:
            h = act(gate_up)
            return self.lora.add(h, self._project(h, gemv))
        if self.quant is not None:
            return self.quant.apply(self, act(gate_up), self.bias)
        launch = gemv.launches.get(self.shape) if gemv is not None else None
        if launch is not None:
            from weft.kernels.skinny import gemv as skinny_gemv

            return skinny_gemv(gate_up, self.weight, self.bias, silu_mul=True, launch=launch,
                               pdl=self.pdl)  # fmt: skip
        return host_linear(act(gate_up), self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; after `use_kernels()`, weft's Triton kernels (CUDA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None

    def use_kernels(self, pdl: bool) -> None:
        from weft.kernels.norm import fused_add_rmsnorm, rmsnorm

        self._kernels = (partial(rmsnorm, pdl=pdl), partial(fused_add_rmsnorm, pdl=pdl))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:
            shape = x.shape
            return self._kernels[0](x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's next step. With the kernel
        both happen in one pass, in place in x and residual."""
        if self._kernels is not None:
            self._kernels[1](x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual

    def with_heads_of(
        self, q: torch.Tensor, k_norm: RMSNorm, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(q), k_norm(k)) over heads, QK-norm: q [T, H, D], k [T, Hk, D]. Where both norms
        run weft's kernels, one launch normalises the heads in place (views into the QKV output
        stay where they are: flattening them for two rmsnorm launches would copy them first)."""
        if self._kernels is not None and k_norm._kernels is not None and self.eps == k_norm.eps:
            from weft.kernels.norm import heads_rmsnorm_

            return heads_rmsnorm_(q, k, self.weight, k_norm.weight, self.eps)
        return self(q), k_norm(k)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x / rms(x) * (1 + w)` in float32, rounded once to x's dtype (HF's
    Gemma3RMSNorm; checkpoints hold w centred on 0). `add_forward` is RMSNorm's unfused one.

    NOTE: no Triton kernel: weft's rmsnorm kernel computes Llama's `round(x / rms(x)) * w`, which
    rounds differently in bf16, so `use_kernels` leaves this module on torch ops."""

    def use_kernels(self, pdl: bool) -> None:
        """Stays on torch ops (see the class note)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * I] -> [T, I]; GeGLU with the tanh approximation (HF's gelu_pytorch_tanh)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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
    """Neox-style rotary embedding (rotate halves) from a precomputed float32 cache, shared by
    every layer with the same settings on the same device. After `use_kernels()`, weft's Triton
    kernel rotates q and k in place (CUDA) from its [cos | sin] cache instead."""

    cos: torch.Tensor
    sin: torch.Tensor
    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.params = params
        self._rotate: Callable[..., None] | None = None
        self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cache(s) in use, e.g. after the module was created on `meta`."""
        names = ("cos_sin",) if self._rotate is not None else ("cos", "sin")
        for name in names:
            table = _rope_table(name, self.head_dim, self.max_positions, self.params, device)
            self.register_buffer(name, table, persistent=False)

    def use_kernels(self) -> None:
        from weft.kernels.rotary import rotary_embedding

        device = self.cos.device
        del self.cos, self.sin
        self._rotate = rotary_embedding
        self.build(device)

    @property
    def stores_kv(self) -> bool:
        """Whether forward can also store k and v into the KV pool (`kv_store`): the kernel
        does it in the same launch where it rotates whole heads."""
        return self._rotate is not None and self.cos_sin.shape[1] == self.head_dim

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]; kv_store: (v, k_buffer, v_buffer, loc)
        if self._rotate is not None:
            self._rotate(positions, q, k, self.cos_sin, kv_store=kv_store)
            return q, k
        if kv_store is not None:
            raise ValueError("RotaryEmbedding stores k and v only with its kernel (stores_kv)")
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


_ROPE_TABLES: weakref.WeakValueDictionary[tuple[object, ...], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


def _rope_table(
    name: str,
    head_dim: int,
    max_positions: int,
    params: dict[str, Any],
    device: torch.device | str | None,
) -> torch.Tensor:
    """cos or sin [P, D] (halves repeated), or the kernel's "cos_sin" [P, D], built once per
    (settings, device) while a model uses it: its layers share it (at a 128k context a table is
    64 MB, so one copy per layer would cost gigabytes)."""
    dev = torch.device(device) if device is not None else torch.empty(0).device  # the default
    key = (name, head_dim, max_positions, repr(sorted(params.items())), str(dev))
    table = _ROPE_TABLES.get(key)
    if table is not None:
        return table
    inv_freq = rope_inv_freq(head_dim, params).to(dev)
    if name == "cos_sin":
        from weft.kernels.rotary import cos_sin_cache

        table = cos_sin_cache(inv_freq, max_positions)
    else:
        freqs = torch.arange(max_positions, device=dev).float()[:, None] * inv_freq[None, :]
        half = freqs.cos() if name == "cos" else freqs.sin()  # [P, D/2]
        table = torch.cat((half, half), dim=-1)
    if dev.type != "meta":
        _ROPE_TABLES[key] = table
    return table


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
