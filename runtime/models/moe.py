"""Mixture-of-experts models (Qwen3-MoE, Mixtral): the sparse MoE block and its expert weights."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.kernels.moe_ref import moe_ref, select_experts
from weft.runtime.models.family import ModelFamily
from weft.runtime.models.layers import GemvPlan
from weft.runtime.models.llama import LlamaForCausalLM, LlamaMLP
from weft.runtime.models.parallel import TPInfo, even_split
from weft.runtime.models.weights import Placement, Weight, read_placed

# model.layers.{i}.{mlp | block_sparse_moe}.{rest}: a sparse layer's router and experts
_MOE_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
# experts.{e}.{part}.weight: one expert's matrix, as published checkpoints store them
_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
# experts.{gate_up_proj | down_proj}: all experts in one 3D tensor (transformers 5 modules)
_FUSED = re.compile(r"experts\.(gate_up_proj|down_proj)(?:\.weight)?")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
         "down_proj": "down", "w2": "down"}  # fmt: skip


class Router(nn.Module):
    """The router: a plain [E, H] matrix in the model's dtype (never quantized, never a GEMV
    plan's Projection), replicated on every tensor-parallel rank."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, H] -> [T, E]


class Experts(nn.Module):
    """Every expert's SwiGLU over this rank's columns: w13 [E, 2 I, H] (gate rows, then up
    rows) and w2 [E, H, I], I = this rank's share of the expert width."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))


class SparseMoeBlock(nn.Module):
    """Route each token to its top_k experts and sum their outputs by the router's weights;
    each expert's width is split over the ranks like LlamaMLP's columns, then all-reduced."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TPInfo,
    ) -> None:
        super().__init__()
        if inter < tp.size:
            raise ValueError(f"tp_size {tp.size} exceeds the expert width {inter}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.tp = tp
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.full_inter = inter
        self.start, self.inter = even_split(inter, tp.size, tp.rank)
        self.gate = Router(num_experts, hidden)
        self.experts = Experts(num_experts, hidden, self.inter)

    def forward(self, x: torch.Tensor, gemv: GemvPlan | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        w13, w2 = self.experts.w13, self.experts.w2
        if x.is_cuda:
            from weft.kernels.moe import fused_moe
            from weft.kernels.moe_route import route_topk

            weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)  # [T, K] each
            out = fused_moe(x, w13, w2, weights, ids)
        else:
            weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
            out = moe_ref(x, w13, w2, weights, ids)
        return self.tp.all_reduce(out)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-shaped model whose sparse layers' MLP is a SparseMoeBlock (`sparse_layer`). Expert
    tensors load per expert (`experts.{e}.gate_proj|up_proj|down_proj` or Mixtral's `w1|w3|w2`)
    or fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), under `mlp.` or
    `block_sparse_moe.`; the rest loads as in LlamaForCausalLM."""

    def make_mlp(self, config: Any, layer: int, tp: TPInfo) -> nn.Module:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        if not self.sparse_layer(config, layer):
            return LlamaMLP(config, tp)
        return SparseMoeBlock(config.hidden_size, self.expert_width(config),
                              num_experts_of(config), int(config.num_experts_per_tok),
                              self.renormalize(config), tp)  # fmt: skip

    def sparse_layer(self, config: Any, layer: int) -> bool:
        return True

    def expert_width(self, config: Any) -> int:
        return int(config.intermediate_size)

    def renormalize(self, config: Any) -> bool:
        return True

    def moe_blocks(self) -> Iterator[tuple[int, SparseMoeBlock]]:
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, SparseMoeBlock):
                yield i, mlp

    ##### Weights #####

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        blocks = dict(self.moe_blocks())
        loaded: set[tuple[int, str, int]] = set()  # (layer, gate | up | down, expert)

        def rest() -> Iterator[tuple[str, Weight]]:
            for name, src in weights:
                match = _MOE_NAME.fullmatch(name)
                block = blocks.get(int(match.group(1))) if match else None
                if match is None or block is None:
                    yield name, src  # not an MoE layer's: a dense MLP's, attention, ...
                elif match.group(2) == "gate.weight":
                    yield f"model.layers.{match.group(1)}.mlp.gate.weight", src
                else:
                    layer = int(match.group(1))
                    for part, expert in _load_expert(block, name, match.group(2), src):
                        loaded.add((layer, part, expert))

        super().load_weights(rest())
        missing = [f"model.layers.{i}.mlp.experts.{e}.{part}"
                   for i, block in blocks.items() for e in range(block.num_experts)
                   for part in ("gate", "up", "down") if (i, part, e) not in loaded]  # fmt: skip
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensor(s), "
                             f"e.g. {missing[:3]}")  # fmt: skip

    def _expected_keys(self) -> list[str]:
        return [k for k in super()._expected_keys() if ".mlp.experts." not in k]

    def checkpoint_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The Llama tensors and the router, with the experts fused (a dummy checkpoint draws
        two tensors per layer rather than 3 E)."""
        out = [(n, s) for n, s in super().checkpoint_shapes() if ".mlp.experts." not in n]
        hidden = self.config.hidden_size
        for i, block in self.moe_blocks():
            e, inter = block.num_experts, block.full_inter
            out.append((f"model.layers.{i}.mlp.experts.gate_up_proj", (e, 2 * inter, hidden)))
            out.append((f"model.layers.{i}.mlp.experts.down_proj", (e, hidden, inter)))
        return out


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: qwen3 attention (QK-norm); sparse layers every decoder_sparse_step except
    mlp_only_layers (dense, intermediate_size); experts moe_intermediate_size wide."""

    def sparse_layer(self, config: Any, layer: int) -> bool:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        only_mlp = list(getattr(config, "mlp_only_layers", None) or [])
        return layer not in only_mlp and num_experts_of(config) > 0 and (layer + 1) % step == 0

    def expert_width(self, config: Any) -> int:
        return int(config.moe_intermediate_size)

    def renormalize(self, config: Any) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral attention; every layer sparse, experts intermediate_size wide, the top-k
    weights always renormalized."""


def num_experts_of(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)


def _load_expert(
    block: SparseMoeBlock, hf_name: str, rest: str, src: Weight
) -> list[tuple[str, int]]:
    """Copy this rank's slice of one expert tensor (or of a fused all-experts one) into the
    block; the (part, expert) pairs it set."""
    hidden, full, start, inter = (
        block.gate.weight.shape[1],
        block.full_inter,
        block.start,
        block.inter,
    )
    w13, w2 = block.experts.w13, block.experts.w2
    match = _EXPERT.fullmatch(rest)
    if match is not None:
        e, part = int(match.group(1)), _PART[match.group(2)]
        if e >= block.num_experts:
            raise ValueError(f"checkpoint tensor {hf_name!r}: expert {e} of {block.num_experts}")
        if part == "down":
            _copy(hf_name, src, (hidden, full), 1, start, inter, w2[e])
        else:
            rows = slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
            _copy(hf_name, src, (full, hidden), 0, start, inter, w13[e, rows])
        return [(part, e)]
    fused = _FUSED.fullmatch(rest)
    if fused is None:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in this model")
    e = block.num_experts
    if fused.group(1) == "down_proj":
        _copy(hf_name, src, (e, hidden, full), 2, start, inter, w2)
        return [("down", i) for i in range(e)]
    _copy(hf_name, src, (e, 2 * full, hidden), 1, start, inter, w13[:, :inter])
    _copy(hf_name, src, (e, 2 * full, hidden), 1, full + start, inter, w13[:, inter:])
    return [(part, i) for part in ("gate", "up") for i in range(e)]


def _copy(
    hf_name: str,
    src: Weight,
    full_shape: tuple[int, ...],
    dim: int,
    start: int,
    size: int,
    dst: torch.Tensor,
) -> None:
    """dst <- src's elements [start, start + size) along dim, after checking src's shape."""
    data = read_placed(hf_name, src, Placement(full_shape, dim, start, size))
    with torch.no_grad():
        dst.copy_(data)


QWEN3_MOE_FAMILY = ModelFamily(
    "Qwen3-MoE", Qwen3MoeForCausalLM, ("Qwen3MoeForCausalLM",), ("qwen3_moe",), quantizable=False
)
MIXTRAL_FAMILY = ModelFamily(
    "Mixtral", MixtralForCausalLM, ("MixtralForCausalLM",), ("mixtral",), quantizable=False
)
