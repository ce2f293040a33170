"""Tensor parallelism inside a model: who holds which heads / columns / vocab rows, and the collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weft.kernels.host_linear import host_linear

if TYPE_CHECKING:
    from weft.runtime.models.quant.base import QuantEmbeddingMethod


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group (size 1: no collectives at all)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group of the model's collectives (None: default)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order); shapes are equal by design."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def even_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, count) of part i when n items are dealt to `parts` as evenly as possible."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: q heads [q_start, q_start + q_count) and their kv heads."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_shard(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """Split heads by GQA group: with at least as many kv heads as ranks, each rank takes whole
    groups (uneven counts allowed); with fewer, each kv head is replicated on tp / num_kv_heads
    ranks, which split that group's q heads."""
    check_heads(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        kv_start, kv_count = even_split(num_kv_heads, tp, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    replicas = tp // num_kv_heads
    kv = rank // replicas
    q_off, q_count = even_split(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_off, q_count, kv, 1)


def check_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """ValueError when a model's heads cannot be spread over tp ranks."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} attention heads are not a multiple of {num_kv_heads} kv heads"
        )
    if num_kv_heads < tp:
        if tp % num_kv_heads:
            raise ValueError(
                f"tp_size {tp} must be a multiple of the model's {num_kv_heads} kv heads "
                "(or at most that many) to replicate them evenly"
            )
        if num_heads < tp:
            raise ValueError(f"tp_size {tp} exceeds the model's {num_heads} attention heads")


def check_tp(config: Any, tp: int) -> None:
    """ValueError naming why this HF config cannot run with tp_size=tp (None: it can)."""
    if tp == 1:
        return
    heads = config.num_attention_heads
    check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, tp)
    if config.intermediate_size < tp:
        raise ValueError(f"tp_size {tp} exceeds the MLP width {config.intermediate_size}")


class _VocabShard(nn.Module):
    """Rows [start, start + per_rank) of a [vocab, dim] matrix (padded to tp * per_rank rows)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPInfo) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.dim = dim
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.count = max(0, min(self.per_rank, vocab_size - self.start))  # real rows held
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        self.quant: QuantEmbeddingMethod | None = None  # quantized rows (runtime/models/quant/)


class VocabParallelEmbedding(_VocabShard):
    """The embedding split by vocab rows; each rank looks up its rows, the sum is all-reduced."""

    def __init__(self, vocab_size: int, dim: int, tp: TPInfo) -> None:
        super().__init__(vocab_size, dim, tp)
        self.dtype = torch.get_default_dtype()  # the model's (a quantized lookup's output)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.count)
        out = self._lookup(local.clamp(0, self.per_rank - 1))
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.embed(self, ids, self.dtype)
        return F.embedding(ids, self.weight)


class ParallelLMHead(_VocabShard):
    """The output projection split by vocab rows like VocabParallelEmbedding; logits all-gathered."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, dim] -> logits [N, vocab] in the weights' dtype, identical on every rank.
        # NOTE: not float32 here: the sampler's fast path takes the argmax of the raw logits, and
        # its other paths copy them to float32 anyway (H200, batch 512 x 128k vocab: the
        # conversion alone took 187 us of a 29 ms decode step)
        if self.quant is not None:
            local = self.quant.apply(self, hidden, None)
        else:
            local = host_linear(hidden, self.weight)
        return self.tp.all_gather_last(local)[:, : self.vocab_size]
