"""The quantization hook: a QuantMethod owns one layer's weight storage, loading and matmul; a
QuantConfig says which layers of a model get which method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from weft.runtime.models.weights import Placement, Weight


class QuantMethod(ABC):
    """How one layer's weight is stored, loaded and applied (one object per layer).

    Lifecycle:
    1. `create_weights(layer)` runs while the model is still on `meta` (build_model): it deletes
       the layer's full-precision `weight` where it keeps another one and registers its own
       storage as parameters of the layer (requires_grad=False). build_model's `to_empty` then
       allocates them on the device, so a quantized weight never exists in full precision.
    2. `load(layer, suffix, shard, src, place)` once per checkpoint tensor `<layer>.<suffix>`
       (suffix one of `checkpoint_suffixes()` or `optional_suffixes()`, e.g. "weight",
       "weight_scale", "input_scale"), for each shard of a fused layer ("q", "k", "v", "gate",
       "up"; "" when not fused). `place` is where this rank's slice of that shard's *weight*
       goes: rows [dst_start, ...) of the layer's [out_features, in_features] matrix (element
       units); a scale tensor goes where its weight's rows go. The method checks shapes.
    3. `finish(layer)` once after every tensor is loaded (e.g. fusing per-shard scales).
    4. `apply(layer, x, bias)` in forward: x [T, in_features] -> [T, out_features] in x's dtype,
       + bias. The method picks its kernels by T (a GEMV for decode batches, a GEMM path for
       prefill); weft's bf16 GemvPlan / graph tuning never covers a quantized layer.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        """Register this layer's storage (on meta: shapes only)."""

    @abstractmethod
    def checkpoint_suffixes(self) -> tuple[str, ...]:
        """The checkpoint tensors `<layer>.<suffix>` every shard of the layer must have."""

    def optional_suffixes(self) -> tuple[str, ...]:
        """Checkpoint tensors the method takes where present (e.g. a static "input_scale")."""
        return ()

    @abstractmethod
    def load(
        self, layer: nn.Module, suffix: str, shard: str, src: Weight, place: Placement
    ) -> None:
        """Copy this rank's part of checkpoint tensor `<layer>.<suffix>` (shard `shard`) in."""

    @abstractmethod
    def finish(self, layer: nn.Module) -> None:
        """Runs once after loading (e.g. per-shard scales made one per-row vector)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias): [T, in_features] -> [T, out_features] in x's dtype."""

    @abstractmethod
    def main_tensor(self, layer: nn.Module) -> torch.Tensor:
        """The contiguous tensor holding (most of) the weight's bytes: what the attention
        kernel may prefetch into the L2 ahead of o_proj."""


class QuantEmbeddingMethod(QuantMethod):
    """A QuantMethod that also serves the vocab embedding (rows looked up by token id) and, for
    tied models, the lm_head through the same storage."""

    @abstractmethod
    def embed(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [T] (local row numbers, all valid) of the weight: [T, in_features]."""


class QuantConfig(ABC):
    """Which method each layer of a model gets: built once per model load from the engine's
    `quantization` and the checkpoint (runtime/models/quant/__init__.py: make_quant_config)."""

    name: ClassVar[str]

    @abstractmethod
    def method(self, prefix: str, layer: nn.Module) -> QuantMethod | None:
        """The method of our layer `prefix` ("layers.3.self_attn.qkv_proj", "layers.3.mlp
        .down_proj", "embed_tokens", "lm_head", ...), or None: it stays in full precision. Called
        for every Projection and the vocab embedding / lm_head of the model (not for an lm_head
        tied to the embedding: it shares the embedding's method and storage)."""

    def dummy_weight(
        self, name: str, shape: tuple[int, ...], seed: int, device: torch.device
    ) -> Weight | None:
        """A random checkpoint tensor `name` for load_format='dummy' where the method needs its
        own format (e.g. GGUF blocks); None: the usual N(0, std) tensor in the model's dtype."""
        return None


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module, QuantMethod]]:
    """(prefix, layer, method) of every layer of `model` that carries a QuantMethod."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant", None)
        if isinstance(method, QuantMethod) and id(module) not in seen:
            seen.add(id(module))
            yield prefix, module, method


def attach(layer: nn.Module, method: QuantMethod, out_features: int, in_features: int) -> None:
    """Give `layer` (on meta) its method and the method's storage; `layer.weight_shape` keeps
    the logical [out, in] of the weight it replaces."""
    assert getattr(layer, "quant", None) is None, "a layer carries one QuantMethod"
    setattr(layer, "quant", method)  # noqa: B010 (a Projection's or vocab shard's attribute)
    setattr(layer, "weight_shape", (out_features, in_features))  # noqa: B010
    method.create_weights(layer, out_features, in_features)


def weight_shape(layer: nn.Module) -> tuple[int, int]:
    """The logical [out, in] of a quantized layer's weight (set by attach)."""
    shape = getattr(layer, "weight_shape", None)
    assert isinstance(shape, tuple), f"{type(layer).__name__} carries no QuantMethod"
    return shape


def storage_parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter for quantized storage (on the current default device: meta at build)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
