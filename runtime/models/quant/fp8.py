"""FP8 W8A8: e4m3 weights with one float32 scale per output row, activations quantized per token
(or by a checkpoint's static input_scale); the row-wise _scaled_mm for prefill, the FP8 skinny GEMV
for decode batches of 1-32 rows, a dequantizing torch path off CUDA."""

from __future__ import annotations

import torch
from torch import nn

from weft.kernels.fp8 import (
    FP8,
    SCALED_MM_ALIGN,
    quantize_per_channel,
    quantize_per_token_ref,
    quantize_static_ref,
)
from weft.runtime.loader.fp8_checkpoint import Fp8Scheme, fp8_scheme
from weft.runtime.models.layers import Projection
from weft.runtime.models.quant import QuantConfig, QuantContext, QuantMethod, storage_parameter
from weft.runtime.models.quant.base import weight_shape
from weft.runtime.models.weights import Placement, Weight, checkpoint_names

GEMV_MAX_ROWS = 32  # decode batches up to this many rows run the FP8 GEMV (kernels/fp8_gemv.py)


class Fp8Config(QuantConfig):
    """Every Projection (q/k/v, o, gate/up, down) in FP8 unless the checkpoint ignores it; the
    embedding and lm_head stay in the model's dtype."""

    name = "fp8"

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def method(self, prefix: str, layer: nn.Module) -> QuantMethod | None:
        if not isinstance(layer, Projection):
            return None
        parts = [hf.removesuffix(".weight") for hf, _ in checkpoint_names(f"model.{prefix}.weight")]
        ignored = [self.scheme.ignores(p) for p in parts]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(f"fp8 checkpoint ignores only some of {', '.join(parts)}, which weft "
                             "fuses into one layer")  # fmt: skip
        return Fp8Method(self.scheme)


def make_config(ctx: QuantContext) -> Fp8Config:
    scheme = fp8_scheme(ctx.hf_config)
    if ctx.dummy and scheme.prequantized:  # random weights: drawn in the dtype, quantized at load
        scheme = Fp8Scheme(ignore=scheme.ignore)
    return Fp8Config(scheme)


class Fp8Method(QuantMethod):
    """One layer's fp8 `weight` [N, K], float32 `weight_scale` [N] and, with static activations,
    `input_scale` [1]. Per-tensor checkpoint scales become per-row ones (each shard's rows get its
    own), block-wise ones are folded into per-row scales at load (each weight re-rounded once)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self._input_scales: dict[str, float] = {}
        self._blocks: list[tuple[torch.Tensor, Placement, int]] = []  # block scales per shard

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        del layer.weight
        layer.weight = storage_parameter((out_features, in_features), FP8)
        layer.weight_scale = storage_parameter((out_features,), torch.float32)
        if self.scheme.static_input:
            layer.input_scale = storage_parameter((1,), torch.float32)

    def checkpoint_suffixes(self) -> tuple[str, ...]:
        if not self.scheme.prequantized:
            return ("weight",)
        static = ("input_scale",) if self.scheme.static_input else ()
        return ("weight", self.scheme.scale_suffix, *static)

    def load(
        self, layer: nn.Module, suffix: str, shard: str, src: Weight, place: Placement
    ) -> None:
        with torch.no_grad():
            if suffix == "weight":
                self._load_weight(layer, src, place)
            elif suffix == "input_scale":
                self._input_scales[shard] = float(_whole(src).float().reshape(-1)[0])
            elif self.scheme.weight == "block":
                self._blocks.append((_whole(src).float(), place, _rows(place)))
            else:
                self._load_scale(layer, src, place)

    def finish(self, layer: nn.Module) -> None:
        with torch.no_grad():
            for scale_inv, place, rows in self._blocks:
                self._fold_blocks(layer, scale_inv, place, rows)
            self._blocks.clear()
            if self.scheme.static_input:  # one quantization of x serves the fused shards: the max
                _input_scale(layer).fill_(max(self._input_scales.values()))
        n, k = weight_shape(layer)
        weight, weight_scale = _storage(layer)
        device = weight.device
        if device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError("quantization='fp8' needs a GPU of compute capability 8.9+ "
                                 f"(Ada, Hopper); {device} is older")  # fmt: skip
            if n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
                raise ValueError(f"quantization='fp8': a [{n}, {k}] projection (this rank's) is not "
                                 f"a multiple of {SCALED_MM_ALIGN}, which the FP8 GEMM needs")  # fmt: skip
        if not torch.isfinite(weight_scale).all() or (weight_scale <= 0).any():
            raise ValueError(f"fp8 weight_scale of a [{n}, {k}] layer has zero, negative or "
                             "non-finite entries")  # fmt: skip

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        static = _input_scale(layer) if self.scheme.static_input else None
        weight, weight_scale = _storage(layer)
        if x.device.type != "cuda":
            return fp8_linear_torch(x, weight, weight_scale, bias, static)
        rows = x.shape[0]
        if 0 < rows <= GEMV_MAX_ROWS:
            from weft.kernels.fp8_gemv import fp8_gemv

            pdl = bool(getattr(layer, "pdl", False))
            return fp8_gemv(x.contiguous(), weight, weight_scale, bias, input_scale=static, pdl=pdl)
        from weft.kernels.fp8 import quantize_activations, scaled_mm

        xq, x_scale = quantize_activations(x.contiguous(), static)
        return scaled_mm(xq, x_scale, weight, weight_scale, bias, x.dtype)

    def main_tensor(self, layer: nn.Module) -> torch.Tensor:
        return _storage(layer)[0]

    ##### Internal Helper Functions #####

    def _load_weight(self, layer: nn.Module, src: Weight, place: Placement) -> None:
        weight, weight_scale = _storage(layer)
        data = _read(src, place)
        rows = slice(place.dst_start, place.dst_start + data.shape[0])
        if self.scheme.prequantized:
            if data.dtype != FP8:
                raise ValueError(f"an fp8 checkpoint's weight is {data.dtype}, expected {FP8}")
            weight[rows].copy_(data)
            return
        if not data.dtype.is_floating_point or data.dtype == FP8:
            raise ValueError(f"quantizing at load takes float weights, got {data.dtype} (an FP8 "
                             "checkpoint names its format in config.json quantization_config)")  # fmt: skip
        q, scale = quantize_per_channel(data.to(weight.device))  # on the GPU when there
        weight[rows].copy_(q)
        weight_scale[rows].copy_(scale)

    def _load_scale(self, layer: nn.Module, src: Weight, place: Placement) -> None:
        scale = _whole(src).float().reshape(-1)
        rows = _rows(place)
        dst = _storage(layer)[1][place.dst_start : place.dst_start + rows]
        if self.scheme.weight == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"a per-tensor weight_scale has {scale.numel()} entries")
            dst.fill_(scale[0].item())
            return
        if scale.numel() != place.full_shape[0]:
            raise ValueError(f"a per-channel weight_scale has {scale.numel()} entries for "
                             f"{place.full_shape[0]} rows")  # fmt: skip
        dst.copy_(scale[place.start : place.start + rows] if place.dim == 0 else scale)

    def _fold_blocks(
        self, layer: nn.Module, scale_inv: torch.Tensor, place: Placement, rows: int
    ) -> None:
        """Rows [dst_start, +rows) of the weight, scaled per block_n x block_k tile, re-quantized
        with one scale per row (row-wise _scaled_mm takes no tiles), in chunks of rows."""
        assert self.scheme.block is not None
        bn, bk = self.scheme.block
        full_n, full_k = place.full_shape
        if tuple(scale_inv.shape) != (-(-full_n // bn), -(-full_k // bk)):
            raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not tile a "
                             f"[{full_n}, {full_k}] weight in {bn} x {bk} blocks")  # fmt: skip
        weight, weight_scale = _storage(layer)
        device = weight.device
        scale_inv = scale_inv.to(device)
        k = weight.shape[1]
        row0 = place.start if place.dim == 0 else 0
        col0 = place.start if place.dim == 1 else 0
        col_block = (torch.arange(k, device=device) + col0) // bk  # [K]
        for r in range(0, rows, 1024):
            n = min(1024, rows - r)
            row_block = (torch.arange(n, device=device) + row0 + r) // bn  # [n]
            scale = scale_inv[row_block][:, col_block]  # [n, K]
            dst = slice(place.dst_start + r, place.dst_start + r + n)
            q, row_scale = quantize_per_channel(weight[dst].float() * scale)
            weight[dst].copy_(q)
            weight_scale[dst].copy_(row_scale)


def fp8_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """W8A8 off CUDA: x quantized as the GPU's GEMM quantizes it, both operands upcast exactly,
    the float32 product scaled (what _scaled_mm computes, up to summation order)."""
    if input_scale is None:
        xq, x_scale = quantize_per_token_ref(x)
    else:
        xq, x_scale = quantize_static_ref(x, input_scale), input_scale.float()
    y = torch.mm(xq.float(), weight.float().T)  # [T, N]
    y = y * x_scale * weight_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


##### Internal Helper Functions #####


def _storage(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's fp8 weight [N, K] and float32 weight_scale [N] (create_weights made them)."""
    weight, scale = layer.weight, layer.weight_scale
    assert isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor)
    return weight, scale


def _input_scale(layer: nn.Module) -> torch.Tensor:
    scale = layer.input_scale
    assert isinstance(scale, torch.Tensor)
    return scale


def _whole(src: Weight) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src.read(-1, 0, 0)


def _read(src: Weight, place: Placement) -> torch.Tensor:
    if place.dim < 0:
        return _whole(src)
    if isinstance(src, torch.Tensor):
        return src.narrow(place.dim, place.start, place.size)
    return src.read(place.dim, place.start, place.size)


def _rows(place: Placement) -> int:
    """The rows of this rank's slice of the shard's weight."""
    return place.size if place.dim == 0 else place.full_shape[0]
