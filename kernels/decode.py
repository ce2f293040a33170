"""Paged decode attention with split-KV (FlashDecoding), GQA-aware: one program per kv-head group;
a KV prefix shared by several requests (SharedPrefix) is read once per block of them (cascade)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .arrivals import arrival_counters
from .attend import LOG2E, _attend
from .common import FP8_KV, FP8_MAX, INDEX_DTYPES, check_tensor, kv_dtypes, supports_pdl
from .l2 import L2Prefetch, prefetch_l2_part
from .rotary import _rope_neox, _to_pool
from .timeline import now, stamps, trace_for

if TYPE_CHECKING:
    from .shared_prefix import SharedPrefix


MERGE_MAX_SPLITS = 32  # sum_here merges up to this many splits (see decode_attention)


class DecodeRope(NamedTuple):
    """The step's new tokens for a decode launch that rotates q and k itself (neox halves over
    whole heads, as rotary_embedding with is_neox) and stores the new k and v into the pool
    before its walk reads them: the separate rotary + store launch folded in."""

    positions: torch.Tensor  # [B] int: each request's new token's position
    cos_sin: torch.Tensor  # [P, D] float32 (rotary.cos_sin_cache; rotary dim = head dim)
    k: torch.Tensor  # [B, Hkv, D] the new tokens' k, not rotated (q's dtype)
    v: torch.Tensor  # [B, Hkv, D]
    loc: torch.Tensor  # [B] int: their slots (req_to_token[req_rows[b], seq_lens[b] - 1])


@triton.jit
def _split_range(length, num_splits, split, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """[start, end) of split `split` of `length` keys: whole blocks per split, the last ragged."""
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, length), split_len


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D]
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Req_to_token,  # [max_reqs, max_context]
    Req_rows,  # [B]
    Seq_lens,  # [B]
    Kv_starts,  # [B] first key of the request's own walk (when HAS_KV_STARTS)
    Part_o,  # [B, H, S, D] float32: each split's normalised output
    Part_lse,  # [B, H, S] float32: each split's log2-sum-exp2 of scores
    Out,  # [B, H, D] (when DIRECT)
    Positions,  # [B] (when ROPE, as the four below): the new token's position
    Cos_sin,  # [P, D] float32: cos then sin per position (rotary.cos_sin_cache)
    K_new,  # [B, Hkv, D] the new token's k, not yet rotated, and its v
    V_new,
    Loc,  # [B] the new token's slot
    Counters,  # [B * Hkv] int32 arrivals per (request, kv head), zeros (SUM_HERE)
    Prefetch,  # uint8 (when PREFETCH): bytes the programs ask the L2 for, the next kernel's
    prefetch_bytes,
    Trace,  # int64 (when TRACE) per program: start, wait returned, walk done, end (ns), SM
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    num_prefix_splits,  # columns col0.. hold the shared prefix's splits (DIRECT, HAS_KV_STARTS)
    col0,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    stride_c,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    G: tl.constexpr,  # q heads per kv head
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= G, >= 16 so tl.dot has a legal shape
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    HAS_KV_STARTS: tl.constexpr,
    V_STAGED: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: merge the prefix's columns (if any) here and write Out
    SUM_HERE: tl.constexpr,  # (not DIRECT, nor HAS_KV_STARTS) the last split to arrive merges
    BLOCK_S: tl.constexpr,  # (SUM_HERE) >= num_splits
    ROPE: tl.constexpr,  # rotate q and the new k here (neox halves, whole heads); store k, v
    SATURATE: tl.constexpr,  # (ROPE) clamp to +-SATURATE before the pool's cast (fp8), if > 0
    PDL: tl.constexpr,  # launched as a programmatic dependent: waits for the kernel before
    TRIGGER: tl.constexpr,  # (PDL) and lets the next kernel launch at once (else as it ends)
    PREFETCH: tl.constexpr,  # 0, or where the programs prefetch into L2: 1 first, 2 after the walk
    TRACE: tl.constexpr,  # write the program's stamps (kernels/timeline.py)
):
    t0 = now() if TRACE else 0
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    part = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
    parts = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    if PREFETCH == 1:  # the bytes do not depend on the kernel before
        prefetch_l2_part(Prefetch, prefetch_bytes, part, parts, 256)
    if PDL:
        if TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
    t1 = now() if TRACE else 0
    t2 = t1
    row = tl.load(Req_rows + b).to(tl.int64)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    kv_start = 0
    if HAS_KV_STARTS:
        kv_start = tl.load(Kv_starts + b).to(tl.int32)
    start, end, _ = _split_range(seq_len - kv_start, num_splits, split, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < G
    hd_mask = h_mask[:, None] & (offs_d < D)[None, :]
    heads = kvh * G + offs_h  # [BLOCK_H] the q heads served by this kv head
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if ROPE:
        d_mask = offs_d < D
        freq = Cos_sin + tl.load(Positions + b).to(tl.int64) * stride_c + offs_d % (D // 2)
        cos = tl.load(freq, mask=d_mask, other=0.0)
        sin = tl.load(freq + D // 2, mask=d_mask, other=0.0)
        if end == seq_len and end > start:  # this split walks the new key: store it first
            slot = tl.load(Loc + b).to(tl.int64)
            k_ptrs = K_new + b * stride_knb + kvh * stride_knh + offs_d
            k_new = _rope_neox(k_ptrs, offs_d, d_mask, cos, sin, D // 2).to(Q.dtype.element_ty)
            k_new = _to_pool(k_new, SATURATE, K_buf.dtype.element_ty)
            tl.store(K_buf + slot * stride_kt + kvh * stride_kh + offs_d, k_new, mask=d_mask)
            v_new = tl.load(V_new + b * stride_vnb + kvh * stride_vnh + offs_d, mask=d_mask)
            v_new = _to_pool(v_new, SATURATE, V_buf.dtype.element_ty)
            tl.store(V_buf + slot * stride_vt + kvh * stride_vh + offs_d, v_new, mask=d_mask)
            tl.debug_barrier()  # the walk's loads of that slot come after every thread's store
    if end > start:
        q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        if ROPE:
            q = _rope_neox(q_ptrs, offs_d, hd_mask, cos, sin, D // 2).to(Q.dtype.element_ty)
        else:
            q = tl.load(q_ptrs, mask=hd_mask, other=0.0)  # [BLOCK_H, BLOCK_D]
        acc, m_i, l_i = _attend(
            q, K_buf, V_buf, Req_to_token + row * stride_rr, kv_start + start, kv_start + end,
            kvh, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
            BLOCK_H, D, BLOCK_D, BLOCK_N, DOT_PRECISION, FP16_DOTS, V_STAGED,
        )  # fmt: skip
        if PREFETCH == 2:
            prefetch_l2_part(Prefetch, prefetch_bytes, part, parts, 256)
        if not DIRECT:
            o_ptrs = Part_o + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
            tl.store(o_ptrs + offs_d[None, :], acc / l_i[:, None], mask=hd_mask)
            lse_ptrs = Part_lse + b * stride_lb + heads * stride_lh + split
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=h_mask)
        if TRACE:
            t2 = now()
    if SUM_HERE:  # every split arrives, walked or not; the last merges the group's q heads
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        group = Counters + b * tl.num_programs(1) + kvh
        if tl.atomic_add(group, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _, _, split_len = _split_range(seq_len - kv_start, num_splits, 0, BLOCK_N)
            used = tl.cdiv(seq_len - kv_start, tl.maximum(split_len, 1))
            _merge_group(Part_o + b * stride_ob + kvh * G * stride_oh,
                         Part_lse + b * stride_lb + kvh * G * stride_lh,
                         Out + b * stride_outb + kvh * G * stride_outh, used, stride_oh,
                         stride_os, stride_lh, stride_outh, G, D, BLOCK_D, BLOCK_S)  # fmt: skip
            tl.atomic_xchg(group, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    if DIRECT:
        if HAS_KV_STARTS:
            # the prefix kernel ran first: fold its used columns into (acc, m_i, l_i); a column
            # is a normalised output o_p with log2-sum-exp2 lse_p, i.e. acc o_p, max lse_p, sum 1
            _, _, prefix_split_len = _split_range(kv_start, num_prefix_splits, 0, PREFIX_BLOCK_N)
            used_prefix = tl.cdiv(kv_start, tl.maximum(prefix_split_len, 1))
            for p in range(0, used_prefix):
                lse_p = tl.load(
                    Part_lse + b * stride_lb + heads * stride_lh + col0 + p,
                    mask=h_mask,
                    other=0.0,
                )  # [BLOCK_H]
                o_ptrs = Part_o + b * stride_ob + heads[:, None] * stride_oh
                o_p = tl.load(o_ptrs + (col0 + p) * stride_os + offs_d[None, :], mask=hd_mask)
                m_new = tl.maximum(m_i, lse_p)
                alpha = tl.exp2(m_i - m_new)
                w = tl.exp2(lse_p - m_new)
                acc = acc * alpha[:, None] + w[:, None] * o_p
                l_i = l_i * alpha + w
                m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (graph padding): zeros
        out_ptrs = Out + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :]
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=hd_mask)
    if TRACE:
        t3 = now()
        stamps(Trace, part, t0, t1, t2, t3)


@triton.jit
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    Part_o,  # [B, H, S, D] float32
    Part_lse,  # [B, H, S] float32
    Seq_lens,  # [B]
    Kv_starts,  # [B] (when HAS_KV_STARTS): > 0 means columns col0.. hold the shared prefix's part
    Out,  # [B, H, D]
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
    PDL: tl.constexpr,
):
    """All of a (request, q head)'s partial results merged (_merge_columns)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    kv_start = 0
    if HAS_KV_STARTS:
        kv_start = tl.load(Kv_starts + b).to(tl.int32)
    # NOTE: splits at or past a walk's length were never written (their buffers hold garbage):
    # read only the first `used` of each kind; a prefix of kv_start keys is split like its block's.
    own = seq_len - kv_start
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


def fp16_dots(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether the kernels take an fp8 pool's dots in float16 (see `_attend`)."""
    return k_buffer.element_size() == 1 and q.dtype != torch.float32


def fp8_v_staging(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether an fp8 pool's V tiles can be converted where they are loaded (`_attend`): the
    conversion is inline PTX, so CUDA only (the interpreter sinks it into the dot as before)."""
    return fp16_dots(q, k_buffer) and q.is_cuda


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_rows: torch.Tensor,  # [B] int
    seq_lens: torch.Tensor,  # [B] int, KV length including this step's token (already stored)
    out: torch.Tensor,  # [B, H, D], written
    scale: float,
    num_kv_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int | None = None,
    *,
    kv_starts: torch.Tensor | None = None,  # [B] int
    shared: SharedPrefix | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_v_staged: bool | None = None,
    pdl: bool = False,
    rope: DecodeRope | None = None,
    sum_here: bool = True,
    l2_prefetch: L2Prefetch | None = None,
    pdl_trigger: bool = True,
) -> torch.Tensor:
    """Attention of each request's one query over its whole paged KV; returns `out`.

    Request b's keys are the slots req_to_token[req_rows[b], :seq_lens[b]]; q head h reads kv head
    h // (H / Hkv). A program serves one (request, kv head, split) and all q heads of its group.

    With `kv_starts` and `shared` (given together), request b walks only [kv_starts[b], seq_lens[b])
    itself; where kv_starts[b] > 0, b is a member of exactly one block of `shared` whose
    block_lens equals kv_starts[b] (same slots: the caller guarantees both), and that block's
    programs supply keys [0, kv_starts[b]). `block_n`, `num_warps`, `num_stages` override the
    per-request kernel's launch (SharedPrefix carries the prefix kernel's). `fp8_v_staged`
    (an fp8 pool under a 16-bit q; CUDA only, the default there) converts V tiles before their
    layout change (`_attend`); False sinks the conversion into the dot operand. `pdl`: the
    split and reduce kernels launch as programmatic dependents where the GPU supports it; with
    `pdl_trigger` False the split kernel still waits for the kernel before but lets the next
    one launch only as it ends (its dependents' programs do not sit on the SMs meanwhile).

    `rope` (not with `shared`): q is not rotated yet, nor is the new k, and neither k nor v is
    in the pool: each program rotates its q heads, and the program whose split ends at the new
    key rotates it and stores it and its v at `rope.loc` first (cast as store_kv casts).

    `sum_here` (2..MERGE_MAX_SPLITS splits, no `shared`): the last program of a (request, kv
    head) to finish its split merges the group's partial results itself (kernels/arrivals.py),
    so no reduce kernel is launched; False launches it (for comparison).

    `l2_prefetch` (CUDA; ignored by the interpreter): the programs ask the L2 for those bytes,
    each its share, at their start or after their walk, for the kernel that runs next (a small
    decode leaves HBM mostly idle; the o_proj weight is the next kernel's read).

    `partials` is an optional workspace (float32 [B', H, S', D] and [B', H, S'] with B' >= B,
    S' >= num_kv_splits + shared.num_splits) so CUDA-graph replays reuse one buffer. No host sync:
    lengths stay on the device, grids depend only on shapes, and splits past a walk's length are
    skipped by both stages. With one split there is no reduce: the split kernel merges the shared
    prefix's columns (if any) and writes `out` itself; without `shared`, `partials` is not used.
    """
    if (kv_starts is None) != (shared is None):
        raise ValueError("decode_attention: kv_starts and shared go together (both or neither)")
    bsz, heads, dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    dev = q.device
    check_tensor(q, "q", (bsz, heads, dim), (torch.float16, torch.bfloat16, torch.float32), dev)
    check_tensor(k_buffer, "k_buffer", (None, num_kv_heads, dim), kv_dtypes(q.dtype), dev)
    check_tensor(v_buffer, "v_buffer", tuple(k_buffer.shape), (k_buffer.dtype,), dev)
    check_tensor(req_to_token, "req_to_token", (None, None), INDEX_DTYPES, dev)
    check_tensor(req_rows, "req_rows", (bsz,), INDEX_DTYPES, dev)
    check_tensor(seq_lens, "seq_lens", (bsz,), INDEX_DTYPES, dev)
    check_tensor(out, "out", (bsz, heads, dim), (q.dtype,), dev)
    assert heads % num_kv_heads == 0, f"{heads} q heads do not group over {num_kv_heads} kv heads"
    fp32 = q.dtype == torch.float32
    v_staged = fp8_v_staging(q, k_buffer) if fp8_v_staged is None else fp8_v_staged
    if v_staged and not fp8_v_staging(q, k_buffer):
        raise ValueError("decode_attention: fp8_v_staged needs an fp8 pool, a 16-bit q, CUDA")
    # NOTE: float32 tiles are halved: at 64 keys the fp32 (FMA) dot spills on sm_90 (ptxas report)
    # an fp8 pool: 128 keys per tile keep a tile's bytes those of 64 bf16 keys (measured best)
    default_n = 32 if fp32 else 128 if k_buffer.element_size() == 1 else 64
    own_launch: tuple[int | None, int | None, int | None] = (None, None, None)
    if shared is not None and k_buffer.element_size() == 1 and not fp32:
        # NOTE: the members' own keys behind a shared prefix are few (the prefix-sharing run:
        # 129-384): 32-key tiles under 2 warps, many programs per SM. H200, 1024 members of 64
        # prefixes of 2048: both kernels 353 -> 280 us at own 160, 440 -> 425 us at own 384
        # (BENCHMARKS.md, fourteenth session)
        own_launch = (32, 2, 2)
    block_n = block_n or own_launch[0] or default_n
    num_warps = num_warps or own_launch[1]
    num_stages = num_stages or own_launch[2]
    assert num_kv_splits >= 1 and block_n >= 16, (num_kv_splits, block_n)
    prefix_splits, prefix_block_n = 0, 16  # nothing shared: the reduce reads no prefix column
    if shared is not None:
        assert kv_starts is not None
        check_tensor(kv_starts, "kv_starts", (bsz,), INDEX_DTYPES, dev)
        for name in ("block_members", "block_rows", "block_lens"):
            t = getattr(shared, name)
            check_tensor(t, name, tuple(t.shape), INDEX_DTYPES, dev)
        # fp8: 128 keys per prefix tile too (H200, 64 prefixes of 2048 shared by 16, 4 splits:
        # 430 vs 452 us for both kernels)
        prefix_splits, prefix_block_n = shared.num_splits, shared.block_n or default_n
    positions, cos_sin, k_new, v_new, loc = (seq_lens, q, q, q, seq_lens) if rope is None else rope
    if rope is not None:  # NOTE: else the five above are not read
        if shared is not None:
            raise ValueError(
                "decode_attention: rope cannot go with shared (the prefix kernel reads q)"
            )
        check_tensor(positions, "rope.positions", (bsz,), INDEX_DTYPES, dev)
        check_tensor(cos_sin, "rope.cos_sin", (None, dim), (torch.float32,), dev)
        check_tensor(k_new, "rope.k", (bsz, num_kv_heads, dim), (q.dtype,), dev)
        check_tensor(v_new, "rope.v", (bsz, num_kv_heads, dim), (q.dtype,), dev)
        check_tensor(loc, "rope.loc", (bsz,), INDEX_DTYPES, dev)
        assert dim % 2 == 0, f"rotary halves need an even head dim, got {dim}"
    if bsz == 0:
        return out
    width = num_kv_splits + prefix_splits
    pdl = pdl and supports_pdl(dev)
    # one split: the split kernel writes `out`, after merging the prefix kernel's columns if any
    direct = num_kv_splits == 1
    if direct and shared is None:
        part_o, part_lse = out, out  # NOTE: not read: nothing to merge
    elif partials is None:
        part_o = torch.empty(bsz, heads, width, dim, dtype=torch.float32, device=dev)
        part_lse = torch.empty(bsz, heads, width, dtype=torch.float32, device=dev)
    else:
        part_o, part_lse = partials
        check_tensor(part_o, "partials[0]", (None, heads, None, dim), (torch.float32,), dev)
        check_tensor(part_lse, "partials[1]", (None, heads, None), (torch.float32,), dev)
        assert part_o.shape[0] >= bsz and part_o.shape[2] >= width, (part_o.shape, width)
        assert part_lse.shape[:3] == part_o.shape[:3], (part_lse.shape, part_o.shape)

    group = heads // num_kv_heads
    block_d = triton.next_power_of_2(dim)
    prefetch_at, prefetch_base = 0, seq_lens  # NOTE: not read without a hint
    if l2_prefetch is not None and dev.type == "cuda":  # the interpreter runs no inline PTX
        prefetch_at, prefetch_base = l2_prefetch.code(), l2_prefetch.base()
    starts = seq_lens if kv_starts is None else kv_starts  # not read without kv_starts
    counters = None
    # NOTE: the merge holds a kv head's [G, splits, D] float32 columns at once: at 64 splits
    # that spills (255 registers and a 240-byte stack on sm_90, bf16 at 4 warps), so more
    # splits than MERGE_MAX_SPLITS take the reduce launch
    if sum_here and not direct and shared is None and num_kv_splits <= MERGE_MAX_SPLITS:
        counters = arrival_counters(dev, "decode", bsz * num_kv_heads)
    if shared is not None:  # NOTE: first, so that a direct split kernel can merge its columns
        from .shared_prefix import shared_prefix_splits  # NOTE: it imports this module

        shared_prefix_splits(q, k_buffer, v_buffer, req_to_token, shared, (part_o, part_lse),
                             scale, num_kv_splits, prefix_block_n)  # fmt: skip
    trace, traced = trace_for("decode_split", bsz * num_kv_heads * num_kv_splits, seq_lens)
    _decode_split_kernel[(bsz, num_kv_heads, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, seq_lens, starts, part_o, part_lse, out,
        positions, cos_sin, k_new, v_new, loc, seq_lens if counters is None else counters,
        prefetch_base, prefetch_base.numel(), trace, scale * LOG2E, num_kv_splits,
        max(prefix_splits, 1), num_kv_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if part_o.dim() == 4 else 0,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        G=group, D=dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, PREFIX_BLOCK_N=prefix_block_n, DOT_PRECISION="ieee" if fp32 else "tf32",
        FP16_DOTS=fp16_dots(q, k_buffer), HAS_KV_STARTS=kv_starts is not None, V_STAGED=v_staged,
        DIRECT=direct, SUM_HERE=counters is not None,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), ROPE=rope is not None,
        SATURATE=FP8_MAX if rope is not None and k_buffer.dtype == FP8_KV else 0.0,
        PDL=pdl, launch_pdl=pdl, TRIGGER=pdl_trigger, PREFETCH=prefetch_at, TRACE=traced,
        num_warps=num_warps or (8 if fp32 else 4), num_stages=num_stages or (2 if fp32 else 3),
    )  # fmt: skip
    if direct or counters is not None:
        return out
    _decode_reduce_kernel[(bsz, heads)](
        part_o, part_lse, seq_lens, starts, out, num_kv_splits, max(prefix_splits, 1),
        num_kv_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        D=dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_kv_splits + prefix_splits),
        BLOCK_N=block_n, PREFIX_BLOCK_N=prefix_block_n, HAS_KV_STARTS=kv_starts is not None,
        PDL=pdl, launch_pdl=pdl, num_warps=4 if width * block_d <= 4096 else 8,
    )  # fmt: skip
    return out
