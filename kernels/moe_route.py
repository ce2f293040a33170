"""The MoE router's top-k in one launch: softmax over the experts, the top_k, renormalized."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, check_tensor

##### Public API #####


def route_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_ref.select_experts in one kernel (the torch version runs six): (weights float32
    [T, top_k], ids int32 [T, top_k]), the softmax over all E experts in float32, its top_k in
    descending order (ties to the lower id), divided by their sum with `renormalize`. The top_k
    are chosen on the logits, which the softmax orders alike. No host synchronisation."""
    tokens, experts = router_logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] for {experts} experts, got {top_k}")
    check_tensor(router_logits, "router_logits", (tokens, experts), FLOATS)
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(experts)
    if tokens:  # (one warp reduces a few hundred logits without shared memory)
        _route_kernel[(tokens,)](
            router_logits, weights, ids, experts, router_logits.stride(0),
            TOP_K=top_k, BLOCK_E=block_e, RENORMALIZE=renormalize,
            num_warps=1 if block_e <= 256 else 4,
        )  # fmt: skip
    return weights, ids


##### Internal Helper Functions #####


@triton.jit
def _route_kernel(  # type: ignore[no-untyped-def]
    Logits,  # [T, E]
    Weights,  # [T, TOP_K] float32
    Ids,  # [T, TOP_K] int32
    experts,
    stride_t,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < experts
    x = tl.load(Logits + token * stride_t + offs, mask=mask, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.where(mask, tl.exp(x - top), 0.0), axis=0)
    chosen = tl.zeros([BLOCK_E], tl.float32)  # exp(x - top) at the chosen experts, else 0
    rank = tl.full([BLOCK_E], -1, tl.int32)  # the place of each chosen expert among the top_k
    for k in tl.static_range(TOP_K):
        best = tl.argmax(x, axis=0, tie_break_left=True)
        tl.store(Ids + token * TOP_K + k, best.to(tl.int32))
        hit = offs == best
        chosen = tl.where(hit, tl.exp(x - top), chosen)
        rank = tl.where(hit, k, rank)
        x = tl.where(hit, float("-inf"), x)
    if RENORMALIZE:
        weight = chosen / tl.sum(chosen, axis=0)
    else:
        weight = chosen / total
    for k in tl.static_range(TOP_K):
        tl.store(Weights + token * TOP_K + k, tl.sum(tl.where(rank == k, weight, 0.0), axis=0))
