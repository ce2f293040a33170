"""Multi-LoRA segmented GEMMs: tokens grouped by adapter slot, shrink x @ A^T then expand into y."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import FLOATS, INDEX_DTYPES, check_tensor
from .moe import align_pairs

NO_LORA = -1  # a token's slot when it runs the base model alone: no tile, no weight read


class LoraIndex(NamedTuple):
    """A batch's T tokens sorted by adapter slot, each slot's run padded to a multiple of block_m
    (the base model's tokens last, in tiles marked NO_LORA); sized by a bound on T and the pool
    size, so no host ever reads the counts. Built once per forward, shared by every layer."""

    sorted_tokens: torch.Tensor  # [capacity] int32: token ids; padding holds T (out of range)
    tile_slot: torch.Tensor  # [capacity // block_m] int32: each tile's slot (NO_LORA: skipped)
    padded: torch.Tensor  # [1] int32: the padded count of all tokens; later tiles are idle
    block_m: int


@dataclass(frozen=True)
class LoraLaunch:
    """Tiling of one shrink + expand: the shrink splits the input dim into split_k chunks (its
    partial sums go to a float32 [split_k, T, slices * R] buffer that the expand adds up), walks
    each chunk block_k at a time; an expand program owns n_iters * block_n output columns of
    block_m tokens (it sums the partials once, then walks them block_n at a time)."""

    split_k: int = 1
    block_k: int = 64
    block_n: int = 64
    n_iters: int = 1
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_k", "block_n", "n_iters", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LoraLaunch.{name} must be a power of 2, got {value}")
        if min(self.block_k, self.block_n) < 16:
            raise ValueError(f"LoraLaunch: blocks must be >= 16 (dot shapes), got {self}")
        if self.split_k < 1:
            raise ValueError(f"LoraLaunch.split_k must be >= 1, got {self.split_k}")


def default_block_m(tokens: int) -> int:
    """Tokens per tile: 16 for decode-sized batches (few tokens per adapter), 64 for prefill."""
    return 16 if tokens <= 128 else 64


def default_launch(tokens: int, in_dim: int, block_m: int) -> LoraLaunch:
    """Few tokens (decode) leave few tiles: split the shrink's input dim (chunks of >= 256) for
    ~128 programs reading the A matrices, and give each expand program 256 columns in one step.
    On the H100, 64 tokens of 8 adapters at Llama-3.1-8B's gate_up / down, that launch ran at
    14.5 / 9.5 us against the best swept 14.5 / 9.3 (64 columns walked 8 at a time, before:
    17.4 / 14.1; `python benchmarks/kernel_lora.py --sweep --tokens 64 --adapters 8 --proj
    gate_up down`)."""
    tiles = max(1, triton.cdiv(tokens, block_m))
    split_k = max(1, min(in_dim // 256, triton.cdiv(128, tiles)))
    if tokens <= 128:
        return LoraLaunch(split_k=split_k, block_k=64, block_n=256, n_iters=1)
    return LoraLaunch(split_k=split_k, block_k=64, block_n=128, n_iters=1, num_warps=8)


##### Public API #####


def segment_token_slots(
    seg_indptr: torch.Tensor,  # [S + 1] int: segment s is tokens [indptr[s], indptr[s + 1])
    seg_slots: torch.Tensor,  # [S] int: each segment's slot (NO_LORA: the base model)
    num_tokens: int,
) -> torch.Tensor:  # [num_tokens] int32
    """Each token's slot from SGMV-style segments (an extend batch: one segment per request),
    without a host synchronisation (the output size is given)."""
    lens = seg_indptr[1:] - seg_indptr[:-1]
    slots = seg_slots.to(torch.int32)
    return torch.repeat_interleave(slots, lens.long(), output_size=num_tokens)


def lora_index(token_slots: torch.Tensor, num_slots: int, block_m: int) -> LoraIndex:
    """Group the tokens of token_slots [T] (slots in [0, num_slots) or NO_LORA) by slot on the
    device (CUDA-graph capturable): a slot's tokens keep ascending order, the base model's come
    after every adapter's. This is the MoE kernel's grouping of pairs by expert (one launch for
    decode-sized batches: moe.align_pairs), with the base model as one more expert whose tiles
    are marked NO_LORA. Capacity: T + min(num_slots + 1, T) * (block_m - 1), rounded up to
    block_m (at most that many runs, each with fewer than block_m padding)."""
    assert token_slots.dim() == 1 and token_slots.dtype in INDEX_DTYPES, (
        f"token_slots: expected a 1-d int tensor, got {tuple(token_slots.shape)} {token_slots.dtype}"
    )
    bucket = torch.where(token_slots < 0, num_slots, token_slots)  # the last one: the base model
    grouped = align_pairs(bucket.view(-1, 1), num_slots + 1, block_m)
    tile_slot = grouped.block_expert
    tile_slot = torch.where(tile_slot >= num_slots, NO_LORA, tile_slot).to(torch.int32)
    return LoraIndex(grouped.sorted_ids, tile_slot, grouped.padded, block_m)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, num_slices * R, in]: slice i's A in rows [i * R, i * R + rank)
    ranks: torch.Tensor,  # [slots] int32: each slot's rank (<= R; 0: no weights, skipped)
    index: LoraIndex,
    num_slices: int,
    launch: LoraLaunch,
    out: torch.Tensor | None = None,  # [split_k, T, num_slices * R] float32
) -> torch.Tensor:
    """out[k, t] = x[t, chunk k] @ a[slot(t), :, chunk k]^T in float32, per input chunk k (the
    expand sums them). Only the tokens of an adapter are written; only rows below a slot's rank
    are read."""
    tokens, in_dim = x.shape
    check_tensor(x, "x", (tokens, in_dim), FLOATS)
    assert a.dim() == 3 and a.shape[1] % num_slices == 0, (
        f"a: expected [slots, {num_slices} * R, {in_dim}], got {tuple(a.shape)}"
    )
    slots, width = a.shape[0], a.shape[1]
    check_tensor(a, "a", (slots, width, in_dim), (x.dtype,), x.device)
    assert a.stride(1) == in_dim, "lora_shrink: a must be contiguous per slot"
    check_tensor(ranks, "ranks", (slots,), INDEX_DTYPES, x.device)
    if out is None:
        out = torch.empty(launch.split_k, tokens, width, dtype=torch.float32, device=x.device)
    check_tensor(out, "out", (launch.split_k, tokens, width), (torch.float32,), x.device)
    assert out.stride(1) == width, "lora_shrink: out must be contiguous per split"
    if tokens == 0 or slots == 0:
        return out
    bk = launch.block_k
    chunk = triton.cdiv(triton.cdiv(in_dim, launch.split_k), bk) * bk
    grid = (index.tile_slot.numel(), launch.split_k)
    _shrink_kernel[grid](
        x, a, ranks, out, index.sorted_tokens, index.tile_slot, index.padded,
        tokens, in_dim, width // num_slices, width, chunk,
        x.stride(0), a.stride(0), out.stride(0),
        BLOCK_M=index.block_m, BLOCK_K=bk, BLOCK_R=max(16, triton.next_power_of_2(width)),
        DOT_PRECISION=_precision(x.dtype), num_warps=launch.num_warps,
    )  # fmt: skip
    return out


def lora_expand(
    partial: torch.Tensor,  # [split_k, T, num_slices * R] float32: lora_shrink's out
    b: torch.Tensor,  # [slots, out, R]: slice i's B in rows [bounds[i], bounds[i + 1])
    scalings: torch.Tensor,  # [slots] float32
    ranks: torch.Tensor,  # [slots] int32
    index: LoraIndex,
    slice_starts: tuple[int, ...],  # the first output column of each slice: (0,), (0, q, q + kv)
    y: torch.Tensor,  # [T, out]: added to in place
    launch: LoraLaunch,
) -> torch.Tensor:
    """y[t, n] += scalings[s] * sum_k partial[k, t, i * R : i * R + rank] @ b[s, n, :rank]^T with
    s = slot(t) and i the slice of column n, float32 accumulation, rounded once into y."""
    split_k, tokens, width = partial.shape
    num_slices = len(slice_starts)
    assert 1 <= num_slices <= 3 and slice_starts[0] == 0, f"slice_starts {slice_starts}"
    out_dim = y.shape[-1]
    check_tensor(y, "y", (tokens, out_dim), FLOATS)
    check_tensor(partial, "partial", (split_k, tokens, width), (torch.float32,), y.device)
    assert partial.stride(1) == width, "lora_expand: partial must be contiguous per split"
    slots = b.shape[0]
    check_tensor(b, "b", (slots, out_dim, width // num_slices), (y.dtype,), y.device)
    assert b.stride(1) == width // num_slices, "lora_expand: b must be contiguous per slot"
    check_tensor(scalings, "scalings", (slots,), (torch.float32,), y.device)
    check_tensor(ranks, "ranks", (slots,), INDEX_DTYPES, y.device)
    if tokens == 0 or slots == 0:
        return y
    starts = [*slice_starts[1:], out_dim, out_dim][:2]  # columns where slices 1 and 2 begin
    grid = (index.tile_slot.numel(), triton.cdiv(out_dim, launch.block_n * launch.n_iters))
    _expand_kernel[grid](
        partial, b, scalings, ranks, y, index.sorted_tokens, index.tile_slot, index.padded,
        tokens, out_dim, width // num_slices, width, split_k, starts[0], starts[1],
        partial.stride(0), b.stride(0), y.stride(0),
        BLOCK_M=index.block_m, BLOCK_N=launch.block_n, N_ITERS=launch.n_iters,
        BLOCK_R=max(16, triton.next_power_of_2(width)),
        DOT_PRECISION=_precision(y.dtype), num_warps=launch.num_warps,
    )  # fmt: skip
    return y


def lora_forward(
    x: torch.Tensor,  # [T, in]
    y: torch.Tensor,  # [T, out]: the base projection of x, added to in place
    a: torch.Tensor,  # [slots, num_slices * R, in]
    b: torch.Tensor,  # [slots, out, R]
    scalings: torch.Tensor,  # [slots] float32
    ranks: torch.Tensor,  # [slots] int32
    index: LoraIndex,
    slice_starts: tuple[int, ...] = (0,),
    launch: LoraLaunch | None = None,
) -> torch.Tensor:
    """y += each token's adapter delta (shrink then expand) for one (fused) projection, as
    lora_ref (kernels/lora_ref.py). No host synchronisation: capturable in a CUDA graph."""
    launch = launch or default_launch(x.shape[0], x.shape[1], index.block_m)
    partial = lora_shrink(x, a, ranks, index, len(slice_starts), launch)
    return lora_expand(partial, b, scalings, ranks, index, slice_starts, y, launch)


##### Internal Helper Functions #####


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _tile(SortedTokens, TileSlot, Padded, RanksPtr, pid_m, num_tokens, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """This tile's token ids [BLOCK_M], their mask, its slot (int64) and the slot's rank; rank 0
    for an idle tile (past the padded count, or the base model's)."""
    slot = tl.load(TileSlot + pid_m)
    live = (pid_m * BLOCK_M < tl.load(Padded)) & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.where(live, tl.load(RanksPtr + slot), 0)
    token = tl.load(SortedTokens + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return token.to(tl.int64), token < num_tokens, slot, rank


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    X,  # [T, in]
    A,  # [slots, width, in]
    Ranks,
    Out,  # [split_k, T, width] float32
    SortedTokens,
    TileSlot,
    Padded,
    num_tokens,
    in_dim,
    max_rank,
    width,
    chunk,
    stride_xt,
    stride_as,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    token, m_mask, slot, rank = _tile(
        SortedTokens, TileSlot, Padded, Ranks, pid_m, num_tokens, BLOCK_M
    )
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = (offs_r < width) & (offs_r % max_rank < rank)
    k_start = split * chunk
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + token[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    a_ptrs = A + slot * stride_as + offs_r[None, :] * in_dim + offs_k[:, None]  # [BLOCK_K, BLOCK_R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    k_end = tl.minimum(k_start + chunk, in_dim)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end - k0 + k_start
        xs = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ws = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xs, ws, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    o_ptrs = Out + split * stride_os + token[:, None] * width + offs_r[None, :]
    tl.store(o_ptrs, acc, mask=m_mask[:, None] & (offs_r < width)[None, :])


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    Partial,  # [split_k, T, width] float32
    B,  # [slots, out, max_rank]
    Scalings,
    Ranks,
    Y,  # [T, out]
    SortedTokens,
    TileSlot,
    Padded,
    num_tokens,
    out_dim,
    max_rank,
    width,
    split_k,
    start1,
    start2,
    stride_ps,
    stride_bs,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    token, m_mask, slot, rank = _tile(
        SortedTokens, TileSlot, Padded, Ranks, pid_m, num_tokens, BLOCK_M
    )
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_slice = offs_r // max_rank
    r_rank = offs_r % max_rank
    r_mask = (offs_r < width) & (r_rank < rank)
    p_ptrs = Partial + token[:, None] * width + offs_r[None, :]  # [BLOCK_M, BLOCK_R]
    p_mask = m_mask[:, None] & r_mask[None, :]
    p = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for _ in range(0, split_k):
        p += tl.load(p_ptrs, mask=p_mask, other=0.0)
        p_ptrs += stride_ps
    scaling = tl.load(Scalings + slot)
    for i in range(0, N_ITERS):
        offs_n = (pid_n * N_ITERS + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_dim
        n_slice = (offs_n >= start1).to(tl.int32) + (offs_n >= start2).to(tl.int32)
        # NOTE: column n reads only its own slice's rank columns of partial; a masked load reads
        # no memory, so b's [out, R] rows are read once although the dot spans every slice's R
        b_ptrs = B + slot * stride_bs + offs_n[None, :].to(tl.int64) * max_rank + r_rank[:, None]
        b_mask = r_mask[:, None] & n_mask[None, :] & (r_slice[:, None] == n_slice[None, :])
        w = tl.load(b_ptrs, mask=b_mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(p, w, input_precision=DOT_PRECISION) * scaling
        y_ptrs = Y + token[:, None] * stride_yt + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(Y.dtype.element_ty), mask=y_mask)
