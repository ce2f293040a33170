"""Fused mixture-of-experts: the (token, slot) pairs grouped by expert, two grouped GEMMs over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, check_tensor

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MoeLaunch:
    """Both GEMMs' tiling: a program owns block_m sorted pairs (one expert's) and block_n output
    columns (of I in the gate/up GEMM, of H in the down GEMM), walking the reduction block_k at a
    time. Every pair segment is padded to a multiple of block_m."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoeLaunch.{name} must be a power of 2, got {value}")
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"MoeLaunch: blocks must be >= 16 (dot shapes), got {self}")
        if self.num_stages < 1:
            raise ValueError(f"MoeLaunch.num_stages must be >= 1, got {self.num_stages}")


def default_launch(
    tokens: int, hidden: int, inter: int, top_k: int = 1, experts: int = 1
) -> MoeLaunch:
    """The tiling for T tokens routed to top_k of `experts` experts, hidden H and intermediate I.
    Few pairs per expert (decode) read weights as GEMVs do: block_m 16, narrow N tiles for more
    programs, long K steps; many pairs (prefill) take square 64-wide tiles."""
    per_expert = tokens * top_k / max(experts, 1)
    if per_expert <= 16:
        narrow = 32 if min(hidden, inter) >= 1024 else 64
        return MoeLaunch(block_m=16, block_n=narrow, block_k=128, num_warps=4, num_stages=4)
    if per_expert <= 48:
        return MoeLaunch(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return MoeLaunch(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


class MoeAlignment(NamedTuple):
    """The T*K pairs (pair p = token p // K, slot p % K) sorted by expert, each expert's run
    padded to a multiple of block_m; sized by the bound, so no host ever reads the counts."""

    sorted_ids: torch.Tensor  # [capacity] int32: pair ids; padding holds T*K (out of range)
    block_expert: torch.Tensor  # [capacity // block_m] int32: the expert of each M block
    padded: torch.Tensor  # [1] int32: the padded pair count; blocks at or past it are idle


##### Public API #####


def align_pairs(topk_ids: torch.Tensor, experts: int, block_m: int) -> MoeAlignment:
    """Group the pairs of topk_ids [T, K] (ids in [0, experts)) by expert with torch ops on the
    device, no host synchronisation (CUDA-graph capturable). Within an expert, pairs keep
    ascending order. The capacity is T*K + min(E, T*K) * (block_m - 1), rounded up to block_m:
    at most that many experts hold pairs, each with at most block_m - 1 padding slots."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    used = min(experts, pairs)
    blocks = triton.cdiv(pairs + used * (block_m - 1), block_m)
    flat = topk_ids.reshape(-1).long()  # [T*K]
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)  # [E]
    starts = torch.cumsum(counts, 0) - counts  # each expert's first place in the sorted pairs
    sorted_experts, order = torch.sort(flat, stable=True)  # order: pair ids, grouped by expert
    rank = torch.arange(pairs, device=device) - starts[sorted_experts]
    dest = padded_ends[sorted_experts] - padded_counts[sorted_experts] + rank
    sorted_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True, out_int32=True)
    block_expert.clamp_(max=experts - 1)  # idle blocks (past the padded count) read none
    return MoeAlignment(sorted_ids, block_expert, padded_ends[-1:].to(torch.int32))


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float
    topk_ids: torch.Tensor,  # [T, K] int, in [0, E)
    out: torch.Tensor | None = None,  # [T, H] in x's dtype
    launch: MoeLaunch | None = None,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * w2[e] @ (silu(gate_e x) * up_e x), e = topk_ids[t, k], as
    moe_ref (kernels/moe_ref.py): float32 accumulation, the activation rounded to x's dtype
    between the GEMMs, the sum over K in float32, rounded once. Only the weights of experts
    that some token selected are read. No host synchronisation: capturable in a CUDA graph.
    Ids outside [0, E) are not checked (that would need the host) and give garbage."""
    tokens, hidden = x.shape
    check_tensor(x, "x", (tokens, hidden), FLOATS)
    assert w13.dim() == 3 and w13.shape[1] % 2 == 0, (
        f"w13: expected [E, 2I, {hidden}], got {tuple(w13.shape)}"
    )
    experts, inter = w13.shape[0], w13.shape[1] // 2
    check_tensor(w13, "w13", (experts, 2 * inter, hidden), (x.dtype,), x.device)
    check_tensor(w2, "w2", (experts, hidden, inter), (x.dtype,), x.device)
    assert w13.stride(1) == hidden and w2.stride(1) == inter, (
        "fused_moe: weights must be contiguous per expert"
    )
    top_k = topk_ids.shape[-1] if topk_ids.dim() == 2 else -1
    check_tensor(topk_ids, "topk_ids", (tokens, top_k), INDEX_DTYPES, x.device)
    check_tensor(topk_weights, "topk_weights", (tokens, top_k), FLOATS, x.device)
    if out is None:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    check_tensor(out, "out", (tokens, hidden), (x.dtype,), x.device)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    launch = launch or default_launch(tokens, hidden, inter, top_k, experts)
    align = align_pairs(topk_ids, experts, launch.block_m)
    pairs = tokens * top_k
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # pair order
    # K == 1: each pair is its token's whole sum, stored rounded into out
    partial = (
        out if top_k == 1 else torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    )
    weights = topk_weights.reshape(-1)  # [T*K] in pair order
    m_blocks = align.block_expert.numel()
    common = {"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k,
              "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
              "num_warps": launch.num_warps, "num_stages": launch.num_stages}  # fmt: skip
    _gate_up_kernel[(m_blocks * triton.cdiv(inter, launch.block_n),)](
        x, w13, act, align.sorted_ids, align.block_expert, align.padded,
        pairs, hidden, inter, x.stride(0), w13.stride(0), top_k, **common,
    )  # fmt: skip
    _down_kernel[(m_blocks * triton.cdiv(hidden, launch.block_n),)](
        act, w2, partial, weights, align.sorted_ids, align.block_expert, align.padded,
        pairs, hidden, inter, w2.stride(0), partial.stride(0), **common,
    )  # fmt: skip
    if top_k > 1:
        out.copy_(partial.view(tokens, top_k, hidden).sum(dim=1))  # float32, rounded once
    return out


##### Internal Helper Functions #####


@triton.jit
def _pair_rows(SortedIds, BlockExpert, pid_m, num_pairs, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """This M block's pair ids [BLOCK_M] (padding masked) and its expert (int64)."""
    pair = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    return pair, pair < num_pairs, expert


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]
    X,  # [T, H]
    W13,  # [E, 2I, H]
    Act,  # [T*K, I]: silu(gate) * up per pair
    SortedIds,
    BlockExpert,
    Padded,
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_we,
    TOP_K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(inter, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    if pid_m * BLOCK_M >= tl.load(Padded):
        return
    pair, m_mask, expert = _pair_rows(SortedIds, BlockExpert, pid_m, num_pairs, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + token[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = W13 + expert * stride_we + offs_n.to(tl.int64)[None, :] * hidden + offs_k[:, None]
    u_ptrs = g_ptrs + inter * hidden  # the up rows follow the expert's I gate rows
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k < hidden - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = gate * tl.sigmoid(gate) * up
    a_ptrs = Act + pair.to(tl.int64)[:, None] * inter + offs_n[None, :]
    tl.store(a_ptrs, y.to(Act.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]
    Act,  # [T*K, I]
    W2,  # [E, H, I]
    Out,  # [T*K, H]: float32 per pair, or (K == 1) [T, H] rounded
    Weights,  # [T*K] the pairs' router weights
    SortedIds,
    BlockExpert,
    Padded,
    num_pairs,
    hidden,
    inter,
    stride_we,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    if pid_m * BLOCK_M >= tl.load(Padded):
        return
    pair, m_mask, expert = _pair_rows(SortedIds, BlockExpert, pid_m, num_pairs, BLOCK_M)
    rows = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Act + rows[:, None] * inter + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = W2 + expert * stride_we + offs_n.to(tl.int64)[None, :] * inter + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc *= tl.load(Weights + rows, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    o_ptrs = Out + rows[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
