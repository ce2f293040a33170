"""Fused mixture-of-experts: the (token, slot) pairs grouped by expert, two grouped GEMMs over them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import FLOATS, INDEX_DTYPES, check_tensor

FUSED_ALIGN_MAX_PAIRS = 1024  # align_pairs runs _align_kernel up to this many (token, slot) pairs
_ALIGN_TILE = 4096  # elements of _align_kernel's [pairs, experts] one-hot tiles (registers)


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
    """Group the pairs of topk_ids [T, K] (ids in [0, experts)) by expert on the device, no host
    synchronisation (CUDA-graph capturable). Within an expert, pairs keep ascending order. The
    capacity is T*K + min(E, T*K) * (block_m - 1), rounded up to block_m: at most that many
    experts hold pairs, each with at most block_m - 1 padding slots."""
    # NOTE: one launch of _align_kernel for decode-sized batches on the GPU (~20 tiny torch kernels
    # cost more than the weights there); its loops over pairs are serial, so larger batches take
    # torch's ops, as do CPU tensors (a LoRA index built in CPU tests; the interpreter's tests
    # call _align_pairs_fused itself)
    if not topk_ids.is_cuda or topk_ids.numel() > FUSED_ALIGN_MAX_PAIRS:
        return _align_pairs_torch(topk_ids, experts, block_m)
    return _align_pairs_fused(topk_ids, experts, block_m)


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
    if top_k > 1:  # the sum over K in float32, rounded once: one launch (torch takes two)
        block = min(1024, triton.next_power_of_2(hidden))
        _sum_pairs_kernel[(tokens, triton.cdiv(hidden, block))](
            partial, out, hidden, out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4
        )
    return out


##### Internal Helper Functions #####


def _capacity_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The M blocks of the alignment's capacity (see align_pairs)."""
    return triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m)


def _align_pairs_torch(topk_ids: torch.Tensor, experts: int, block_m: int) -> MoeAlignment:
    """align_pairs with ~20 torch ops (scatter_add, cumsum, sort, searchsorted, ...): exact at any
    pair count, and the reference the fused _align_kernel is tested against."""
    pairs = topk_ids.numel()
    device = topk_ids.device
    blocks = _capacity_blocks(pairs, experts, block_m)
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


def _align_pairs_fused(topk_ids: torch.Tensor, experts: int, block_m: int) -> MoeAlignment:
    """align_pairs in one launch of _align_kernel (a single program): exact at any pair count."""
    pairs = topk_ids.numel()
    blocks = _capacity_blocks(pairs, experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=topk_ids.device)
    padded = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    block_e = triton.next_power_of_2(experts)
    per_row = max(1, _ALIGN_TILE // block_e)  # rows of a [rows, BLOCK_E] tile
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, padded, pairs, experts, blocks,
        BLOCK_M=block_m, BLOCK_E=block_e,
        CHUNK=min(per_row, triton.next_power_of_2(max(pairs, 1))),
        BLOCK_B=min(per_row, triton.next_power_of_2(max(blocks, 1))),
        FILL=min(1024, triton.next_power_of_2(max(blocks * block_m, 1))), num_warps=4,
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_expert, padded)


@triton.jit
def _one_hot(TopkIds, c0, num_pairs, experts, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Pairs c0 .. c0 + CHUNK: their ids [CHUNK] and one-hot experts [CHUNK, BLOCK_E] int32
    (rows past the pairs all zero)."""
    pair = c0 + tl.arange(0, CHUNK)
    ids = tl.load(TopkIds + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    return pair, (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _align_kernel(  # type: ignore[no-untyped-def]
    TopkIds,  # [T*K] int32 or int64
    SortedIds,  # [blocks * BLOCK_M] int32
    BlockExpert,  # [blocks] int32
    Padded,  # [1] int32
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # experts, padded to a power of 2
    CHUNK: tl.constexpr,  # pairs per step
    BLOCK_B: tl.constexpr,  # M blocks per step
    FILL: tl.constexpr,  # padding slots per store
):
    """align_pairs in one program: count the pairs per expert, fill with padding, then scatter
    each pair to its expert's padded start + its rank among the expert's pairs so far."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        counts += tl.sum(_one_hot(TopkIds, c0, num_pairs, experts, CHUNK)[1], axis=0)
    padded_counts = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # 0 for experts >= E
    ends = tl.cumsum(padded_counts, axis=0)  # [BLOCK_E]
    capacity = num_blocks * BLOCK_M
    for s0 in range(0, capacity, FILL):
        slot = s0 + tl.arange(0, FILL)
        tl.store(SortedIds + slot, tl.full([FILL], 0, tl.int32) + num_pairs, mask=slot < capacity)
    tl.debug_barrier()  # NOTE: the padding lands before the pairs overwrite their slots
    next_slot = ends - padded_counts  # [BLOCK_E]: where each expert's next pair goes
    for c0 in range(0, num_pairs, CHUNK):
        pair, hot = _one_hot(TopkIds, c0, num_pairs, experts, CHUNK)
        upto = tl.cumsum(hot, axis=0) + next_slot[None, :]  # [CHUNK, BLOCK_E]
        dest = tl.sum(tl.where(hot != 0, upto, 0), axis=1) - 1
        tl.store(SortedIds + dest, pair, mask=pair < num_pairs)
        next_slot += tl.sum(hot, axis=0)
    for b0 in range(0, num_blocks, BLOCK_B):
        block = b0 + tl.arange(0, BLOCK_B)
        ended = (ends[None, :] <= block[:, None] * BLOCK_M) & (experts < num_experts)[None, :]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
        tl.store(BlockExpert + block, expert, mask=block < num_blocks)
    tl.store(Padded, tl.sum(padded_counts, axis=0))


@triton.jit
def _sum_pairs_kernel(  # type: ignore[no-untyped-def]
    Partial,  # [T * TOP_K, H] float32, contiguous
    Out,  # [T, H]
    hidden,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(Partial + (token * TOP_K + k) * hidden + offs, mask=mask, other=0.0)
    tl.store(Out + token * stride_ot + offs, acc.to(Out.dtype.element_ty), mask=mask)


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
