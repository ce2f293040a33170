"""Split-KV decode: how many splits a batch's contexts are walked in (a model of the kernel's
waves on the GPU), each split's key range, and the merges of the splits' partial results."""

from __future__ import annotations

import triton
import triton.language as tl

# One 64-key block per split is enough work once the reduce merges all splits in one pass
# (was 256 with a serial merge; `benchmarks/kernel.py decode --splits`).
MIN_SPLIT_TOKENS = 64
# The split count's model (decode_num_kv_splits), fitted to the default bf16 launch (64 keys,
# 4 warps) at kv 2048 in CUDA graphs on the H200, batch 1 to 128 (`benchmarks/kernel.py decode
# --splits --batches 1 2 4 8 16 32 64 128`): it picks the measured best count (or one within 2% of it) at every batch there;
# the old rule (~4 programs per SM) ran 4-21% slower at batches 8-96.
RESIDENT_PROGRAMS = 4
SATURATING_PROGRAMS = 2.4
SPLIT_COST = 0.96
# The same model for an fp8 pool's launch (128 keys, 4 warps, 3 stages: 140-146 registers and
# 73 KB of shared memory, so 3 programs per SM), fitted the same way at batch 1 to 512: it picks
# the measured best at every batch but 1 (32 splits, 13.1 us, against 16 at 12.3). The bf16
# model there picked counts up to 17% slower (batch 64: 124.6 vs 106.7 us; `benchmarks/kernel.py
# decode --fp8 --splits`).
FP8_RESIDENT_PROGRAMS = 3
FP8_SATURATING_PROGRAMS = 1.6
FP8_SPLIT_COST = 0.93


def decode_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132, fp8: bool = False
) -> int:
    """The power-of-2 split count (each split at least MIN_SPLIT_TOKENS of the longest context)
    that best fills the SMs, by a model of the kernel's waves fitted on the H200:

    - an SM holds RESIDENT_PROGRAMS programs at once, so the grid runs in rounds of that many
      per SM, the last one partial;
    - a round takes at least the time of SATURATING_PROGRAMS programs: fewer programs per SM
      do not draw the SM's share of the memory bandwidth;
    - each doubling of the splits costs SPLIT_COST (the partials and their reduce);
    - `fp8` (an fp8 pool, whose launch differs) takes the FP8_ constants instead.

    (A split's length follows each request's own length at run time, so a CUDA graph captured
    for the longest context still spreads a short one over all its splits.)"""
    cap = max(1, min(64, max_seq_len // MIN_SPLIT_TOKENS))
    programs = max(batch_size * num_kv_heads, 1)
    resident, saturating, split_cost = (
        (FP8_RESIDENT_PROGRAMS, FP8_SATURATING_PROGRAMS, FP8_SPLIT_COST)
        if fp8
        else (RESIDENT_PROGRAMS, SATURATING_PROGRAMS, SPLIT_COST)
    )
    best, best_score, splits, cost = 1, 0.0, 1, 1.0
    while splits <= cap:
        per_sm = programs * splits / num_sms
        full, last = divmod(per_sm, resident)
        rounds = full * resident + (max(last, saturating) if last > 0 else 0)
        score = per_sm / rounds * cost
        if score > best_score * (1 + 1e-6):  # ties go to fewer splits
            best, best_score = splits, score
        splits, cost = splits * 2, cost * split_cost
    return best


##### The splits' key ranges and merges (Triton) #####


@triton.jit
def _split_range(length, num_splits, split, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """[start, end) of split `split` of `length` keys: whole blocks per split, the last ragged."""
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, length), split_len


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    Part_o,  # [B, H, S, D] float32
    Part_lse,  # [B, H, S] float32
    Seq_lens,  # [B]
    Kv_starts,  # [B] (when HAS_KV_STARTS): > 0 means columns col0.. hold the shared prefix's part
    Out,  # [B, H, D]
    window,  # (when HAS_WINDOW) a request's splits divide its last min(window, seq_len) keys
    num_splits,
    num_prefix_splits,
    col0,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= the columns read: num_splits + num_prefix_splits
    BLOCK_N: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    HAS_KV_STARTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,  # (not with HAS_KV_STARTS)
):
    """All of a (request, q head)'s partial results merged (_merge_columns)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    kv_start = 0  # the shared prefix's keys (columns col0..)
    if HAS_KV_STARTS:
        kv_start = tl.load(Kv_starts + b).to(tl.int32)
    # NOTE: splits at or past a walk's length were never written (their buffers hold garbage):
    # read only the first `used` of each kind; a prefix of kv_start keys is split like its block's.
    own = seq_len - kv_start
    if HAS_WINDOW:  # the split kernel walked only the window
        own = tl.minimum(seq_len, window)
    _, _, split_len = _split_range(own, num_splits, 0, BLOCK_N)
    used = tl.cdiv(own, tl.maximum(split_len, 1))
    _, _, prefix_split_len = _split_range(kv_start, num_prefix_splits, 0, PREFIX_BLOCK_N)
    used_prefix = tl.cdiv(kv_start, tl.maximum(prefix_split_len, 1))
    _merge_columns(Part_o + b * stride_ob + h * stride_oh, Part_lse + b * stride_lb + h * stride_lh,
                   Out + b * stride_outb + h * stride_outh, used, used_prefix, col0, stride_os,
                   D, BLOCK_D, BLOCK_S)  # fmt: skip


@triton.jit
def _merge_group(  # type: ignore[no-untyped-def]
    O_rows,  # the group's first q head's partial outputs: head i, column c at + i * stride_oh
    Lse_rows,  # + c * stride_os; their log2-sum-exp2 at Lse_rows + i * stride_lh + c
    Out_rows,
    used,  # columns 0..used-1 hold the walked splits
    stride_oh,
    stride_os,
    stride_lh,
    stride_outh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """_merge_columns for the G q heads of a kv head at once: one load of every column, one
    store (head by head, each head's loads would wait for the store before them). Reads past
    the L1: other programs of this launch wrote the columns."""
    BLOCK_G: tl.constexpr = triton.next_power_of_2(G)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_g < G)[:, None] & (offs_s < used)[None, :]  # [BLOCK_G, BLOCK_S]
    lse_ptrs = Lse_rows + offs_g[:, None] * stride_lh + offs_s[None, :]
    lse = tl.load(lse_ptrs, mask=valid, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, 1)
    w = tl.where(valid, tl.exp2(lse - m[:, None]), 0.0)  # no valid column (padded row): all 0
    o_ptrs = (O_rows + offs_g[:, None, None] * stride_oh + offs_s[None, :, None] * stride_os
              + offs_d[None, None, :])  # fmt: skip
    o_mask = valid[:, :, None] & (offs_d < D)[None, None, :]
    o = tl.load(o_ptrs, mask=o_mask, other=0.0, cache_modifier=".cg")  # [BLOCK_G, BLOCK_S, BLOCK_D]
    total = tl.sum(w, 1)
    out = tl.sum(w[:, :, None] * o, 1) / tl.where(total > 0, total, 1.0)[:, None]
    out_ptrs = Out_rows + offs_g[:, None] * stride_outh + offs_d[None, :]
    out_mask = (offs_g < G)[:, None] & (offs_d < D)[None, :]
    tl.store(out_ptrs, out.to(Out_rows.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_columns(  # type: ignore[no-untyped-def]
    O_row,  # one (request, q head)'s partial outputs: column c at O_row + c * stride_os
    Lse_row,  # its columns' log2-sum-exp2
    Out_row,
    used,  # columns 0..used-1 hold its own splits
    used_prefix,  # columns col0..col0+used_prefix-1 the shared prefix's
    col0,
    stride_os,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Out_row = the softmax-weighted merge of the used columns, in one pass (no loop of
    dependent loads: at batch 1 with 32+ splits a serial merge is latency-bound)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    valid = offs_s < used + used_prefix
    col = tl.where(offs_s < used, offs_s, col0 + offs_s - used)
    lse = tl.load(Lse_row + col, mask=valid, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(valid, tl.exp2(lse - m), 0.0)  # [BLOCK_S]; no valid column (padded row): all 0
    o_ptrs = O_row + col[:, None] * stride_os + offs_d[None, :]
    o = tl.load(o_ptrs, mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # seq_len 0 gives zeros
    tl.store(Out_row + offs_d, out.to(Out_row.dtype.element_ty), mask=offs_d < D)
