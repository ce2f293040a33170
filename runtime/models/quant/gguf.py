"""GGUF kept quantized: each layer's Q4_0..Q8_0 / K-quant blocks stay raw uint8 in device memory;
decode runs the dequantizing Triton matmul, prefill a dense GEMM over dequantized tiles, the CPU
the torch dequantizer; the vocab embedding gathers rows of blocks."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weft.kernels import gguf as kgguf
from weft.kernels.host_linear import host_linear
from weft.runtime.models.layers import Projection
from weft.runtime.models.quant import QuantContext
from weft.runtime.models.quant.base import (
    QuantConfig,
    QuantEmbeddingMethod,
    QuantMethod,
    storage_parameter,
)
from weft.runtime.models.weights import Placement, Weight, checkpoint_names

# rows of a prefill GEMM's dequantized weight at a time on CUDA (16384 x 8960 bf16: 294 MB)
DENSE_CHUNK_ROWS = 16384
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # loaded in the model's dtype, as today


@dataclass(frozen=True)
class Part:
    """Rows [start, start + rows) of a (fused) layer held in one format: a ggml quant type's
    blocks, or (ggml_id in _FLOAT_TYPES) a dense matrix in the model's dtype."""

    start: int
    rows: int
    ggml_id: int
    shards: tuple[str, ...]

    @property
    def quantized(self) -> bool:
        return self.ggml_id not in _FLOAT_TYPES


class GGUFLinear(QuantEmbeddingMethod):
    """A layer's weight as GGUF blocks: one storage parameter per run of shards of the same type
    (`part{i}`: uint8 [rows, row_bytes] or a dense [rows, K])."""

    def __init__(self, name: str, parts: list[Part]) -> None:
        self.name = name
        self.parts = parts
        self.k = 0

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        assert sum(p.rows for p in self.parts) == out_features, (self.name, self.parts)
        self.k = in_features
        del layer.weight
        for i, part in enumerate(self.parts):
            if part.quantized:
                shape = (part.rows, kgguf.block_type(part.ggml_id).row_bytes(in_features))
                param = storage_parameter(shape, torch.uint8)
            else:
                param = storage_parameter((part.rows, in_features), torch.get_default_dtype())
            layer.register_parameter(f"part{i}", param)

    def checkpoint_suffixes(self) -> tuple[str, ...]:
        return ("weight",)

    def load(self, layer: nn.Module, suffix: str, shard: str, src: Weight,
             place: Placement) -> None:  # fmt: skip
        from weft.runtime.loader.gguf_tensors import BlockTensor

        index = next(i for i, p in enumerate(self.parts) if shard in p.shards)
        part, dst = self.parts[index], _part(layer, index)
        if not isinstance(src, BlockTensor):
            raise ValueError(f"{self.name}: a GGUF layer loads tensors of its GGUF file, got a "
                             f"{type(src).__name__}")  # fmt: skip
        if src.ggml_id != part.ggml_id:
            raise ValueError(f"{self.name}: shard {shard!r} is {src.qtype.name} in the file, "
                             f"the layer was built for type {part.ggml_id}")  # fmt: skip
        if part.quantized:
            data = src.read_blocks(place.dim, place.start, place.size)
        else:
            data = src.read(place.dim, place.start, place.size)
        rows = dst.narrow(0, place.dst_start - part.start, data.shape[0])
        if rows.shape != data.shape:
            raise ValueError(f"{self.name}: slice {tuple(data.shape)} does not fit "
                             f"{tuple(rows.shape)}")  # fmt: skip
        with torch.no_grad():
            rows.copy_(data)

    def finish(self, layer: nn.Module) -> None:
        """Nothing to combine: the blocks are used as loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if len(self.parts) == 1:
            return self._run(self.parts[0], _part(layer, 0), x, bias, None)
        out = torch.empty(x.shape[0], sum(p.rows for p in self.parts), dtype=x.dtype,
                          device=x.device)  # fmt: skip
        for i, part in enumerate(self.parts):
            cols = out[:, part.start : part.start + part.rows]
            b = bias[part.start : part.start + part.rows] if bias is not None else None
            self._run(part, _part(layer, i), x, b, cols)
        return out

    def embed(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        (part,) = self.parts
        if not part.quantized:
            return nn.functional.embedding(ids, _part(layer, 0))
        return kgguf.embedding(ids, _part(layer, 0), part.ggml_id, self.k, dtype)

    def main_tensor(self, layer: nn.Module) -> torch.Tensor:
        largest = max(range(len(self.parts)), key=lambda i: self.parts[i].rows)
        return _part(layer, largest)

    def _run(self, part: Part, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """x @ part^T (+ bias), into `out` (a column slice) when given."""
        if not part.quantized:
            y = host_linear(x, w, bias)
        elif x.device.type == "cuda" and x.shape[0] <= _gemv_rows():
            from weft.kernels.gguf_gemv import matmul

            return matmul(x, w, part.ggml_id, bias, out=out)
        elif x.device.type == "cuda":
            y = _dense(x, w, part.ggml_id, bias)
        else:
            y = kgguf.linear(x, w, part.ggml_id, bias)
        if out is None:
            return y
        out.copy_(y)
        return out


def _part(layer: nn.Module, i: int) -> torch.Tensor:
    param = getattr(layer, f"part{i}")
    assert isinstance(param, torch.Tensor)
    return param


def _gemv_rows() -> int:
    from weft.kernels.gguf_gemv import MAX_ROWS

    return MAX_ROWS


def _dense(x: torch.Tensor, blocks: torch.Tensor, ggml_id: int,
           bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Prefill on CUDA: W dequantized by the Triton kernel DENSE_CHUNK_ROWS rows at a time into
    x's dtype, each chunk one cuBLAS GEMM."""
    from weft.kernels.gguf_gemv import dequantize

    n, k = blocks.shape[0], x.shape[1]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, DENSE_CHUNK_ROWS):
        w = dequantize(blocks[start : start + DENSE_CHUNK_ROWS], ggml_id, k, x.dtype)
        torch.matmul(x, w.t(), out=out[:, start : start + w.shape[0]])
    if bias is not None:
        out += bias
    return out


class GGUFQuantConfig(QuantConfig):
    """Per HF tensor name, its ggml type (from the file, or a layout for dummy weights); layers
    whose tensors are all F32/F16/BF16 stay dense. `fused`: our fused layer -> its shards' row
    counts (from the model config: q/k/v heads, gate/up widths)."""

    name = "gguf"

    def __init__(self, types: dict[str, int], hf_config: Any) -> None:
        self.types = types
        self.hf_config = hf_config

    def method(self, prefix: str, layer: nn.Module) -> QuantMethod | None:
        hf = prefix if prefix == "lm_head" else f"model.{prefix}"
        shards = checkpoint_names(f"{hf}.weight")
        rows = self._shard_rows(prefix, layer, len(shards))
        kinds = []
        for (name, shard), count in zip(shards, rows, strict=True):
            if name not in self.types:
                raise ValueError(f"the GGUF file has no tensor for {name}")
            ggml_id = self.types[name]
            if ggml_id not in kgguf.TYPES and ggml_id not in _FLOAT_TYPES:
                raise ValueError(f"{name} has ggml type {ggml_id}, which weft does not keep "
                                 f"quantized ({', '.join(t.name for t in kgguf.TYPES.values())}); "
                                 "pass dequantize=True")  # fmt: skip
            kinds.append((shard, count, ggml_id))
        if all(g in _FLOAT_TYPES for _, _, g in kinds):
            return None
        parts: list[Part] = []
        start = 0
        for shard, count, ggml_id in kinds:
            if parts and parts[-1].ggml_id == ggml_id:
                last = parts[-1]
                parts[-1] = Part(last.start, last.rows + count, ggml_id, (*last.shards, shard))
            else:
                parts.append(Part(start, count, ggml_id, (shard,)))
            start += count
        return GGUFLinear(prefix, parts)

    def dummy_weight(self, name: str, shape: tuple[int, ...], seed: int,
                     device: torch.device) -> Weight | None:  # fmt: skip
        ggml_id = self.types.get(name)
        if ggml_id is None or ggml_id in _FLOAT_TYPES:
            return None
        from weft.runtime.loader.gguf_tensors import BlockTensor

        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        blocks = kgguf.random_blocks(ggml_id, shape[0], shape[1], gen, device)
        return BlockTensor.of_blocks(name, shape, ggml_id, blocks)

    def _shard_rows(self, prefix: str, layer: nn.Module, count: int) -> list[int]:
        if count == 1:
            if isinstance(layer, Projection):
                return [layer.out_features]
            per_rank = getattr(layer, "per_rank")  # noqa: B009 (a vocab shard's rows)
            return [int(per_rank)]
        c = self.hf_config
        if prefix.endswith("qkv_proj"):
            d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * d
            return [c.num_attention_heads * d, kv, kv]
        assert prefix.endswith("gate_up_proj"), prefix
        return [c.intermediate_size, c.intermediate_size]


def q4_k_m_types(hf_config: Any) -> dict[str, int]:
    """llama.cpp's Q4_K_M choice of types for a Llama-family model: Q4_K, with Q6_K for the
    output and for attn_v / ffn_down in its "more bits" layers (the first and last eighth and
    every third in between); rows not a multiple of 256 fall back to Q5_0 / Q8_0 like llama.cpp."""
    n = hf_config.num_hidden_layers
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size

    def more_bits(i: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def fit(ggml_id: int, k: int) -> int:
        return ggml_id if k % 256 == 0 else {12: 6, 14: 8}[ggml_id]

    types = {"model.embed_tokens.weight": fit(12, hidden)}
    if not getattr(hf_config, "tie_word_embeddings", False):
        types["lm_head.weight"] = fit(14, hidden)
    for i in range(n):
        p = f"model.layers.{i}."
        six = 14 if more_bits(i) else 12
        for name in ("q_proj", "k_proj", "o_proj"):  # o_proj's K: heads x head_dim = hidden
            types[f"{p}self_attn.{name}.weight"] = fit(12, hidden)
        types[f"{p}self_attn.v_proj.weight"] = fit(six, hidden)
        types[f"{p}mlp.gate_proj.weight"] = fit(12, hidden)
        types[f"{p}mlp.up_proj.weight"] = fit(12, hidden)
        types[f"{p}mlp.down_proj.weight"] = fit(six, inter)
    return types


def make_config(ctx: QuantContext) -> GGUFQuantConfig:
    """From the file's tensor types, or (dummy weights) the Q4_K_M layout."""
    if ctx.dummy:
        return GGUFQuantConfig(q4_k_m_types(ctx.hf_config), ctx.hf_config)
    from weft.runtime.loader.gguf_header import read_gguf_header
    from weft.runtime.loader.gguf_tensors import gguf_tensor_types

    if ctx.checkpoint is None or ctx.checkpoint.suffix.lower() != ".gguf":
        raise ValueError(f"quantization='gguf' reads a .gguf file, got {ctx.checkpoint}")
    return GGUFQuantConfig(gguf_tensor_types(read_gguf_header(ctx.checkpoint)), ctx.hf_config)
