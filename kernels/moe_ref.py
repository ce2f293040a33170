"""Mixture-of-experts in plain PyTorch: the router's top-k choice and the naive loop over experts
that the fused MoE kernel (kernels/moe.py) must match."""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, top_k], expert ids int32 [T, top_k]): softmax over all experts in
    float32, the top_k largest; with `renormalize` (Qwen3-MoE's norm_topk_prob, Mixtral always)
    the chosen weights divided by their sum. Ties go to the lower expert id, as torch.topk."""
    tokens, experts = router_logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] for {experts} experts, got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float
    topk_ids: torch.Tensor,  # [T, K] int, in [0, E)
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e x) * up_e x) with e = topk_ids[t, k]:
    one expert at a time over the tokens routed to it, float32 throughout, rounded once."""
    tokens, hidden = x.shape
    experts, width, _ = w13.shape
    inter = width // 2
    if w13.shape != (experts, 2 * inter, hidden) or w2.shape != (experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}: want [E, 2I, {hidden}] and [E, {hidden}, I]")  # fmt: skip
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{tokens}, K]")  # fmt: skip
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    x32 = x.float()
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gate_up = x32[tok] @ w13[e].float().t()  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].float().t()  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
