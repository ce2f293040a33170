"""LoRA in the model's forward: the per-forward state (each token's adapter slot, the kernels'
index), and the site each adapted Projection carries to add its delta.

    ModelRunner: ForwardBatch.lora = LoraBatch (built once per forward; None: no adapter token)
        with LoraContext.use(fb.lora): model(fb)      (refuses nesting)
            Projection.forward: y = x @ W^T; y += site.delta   (site: this layer's fused projection)

The sites read the batch through the context rather than an argument: the models call their
projections as `proj(x, gemv)` (Gemma 3's MLP too), and the state is the same for every layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from weft.kernels.lora_ref import lora_ref

if TYPE_CHECKING:
    from weft.kernels.lora import LoraIndex
    from weft.runtime.lora.pool import LoraPool


@dataclass(frozen=True)
class LoraBatch:
    """One forward's LoRA inputs. T = the forward's tokens."""

    pool: LoraPool
    token_slots: torch.Tensor  # [T] int32: each token's pool slot, NO_LORA (-1): the base model
    index: LoraIndex | None  # CUDA: kernels/lora.py's grouping of the tokens; None: lora_ref


class LoraContext:
    """The LoRA batch of the forward running now, shared by a model's sites."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None
        self._active = False

    @contextmanager
    def use(self, batch: LoraBatch | None) -> Iterator[None]:
        assert not self._active, "LoraContext.use is not re-entrant (one forward at a time)"
        self._active, self.batch = True, batch
        try:
            yield
        finally:
            self._active, self.batch = False, None


class LoraSite:
    """Projection `fused` of `layer`: adds the delta of each token's adapter to its output."""

    def __init__(self, context: LoraContext, layer: int, fused: str) -> None:
        self.context = context
        self.layer = layer
        self.fused = fused

    @property
    def active(self) -> bool:
        """Whether this forward carries adapter tokens."""
        return self.context.batch is not None

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x: [T, in] the projection's input; y: [T, out] its output -> y + the adapters' deltas
        batch = self.context.batch
        if batch is None:
            return y
        w = batch.pool.weights(self.layer, self.fused)
        if batch.index is None:
            return lora_ref(x, y, w.a, w.b, w.scalings, w.ranks, batch.token_slots, w.slice_starts)
        from weft.kernels.lora import lora_forward

        return lora_forward(x, y, w.a, w.b, w.scalings, w.ranks, batch.index, w.slice_starts)
