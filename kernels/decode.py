"""Paged decode attention with split-KV (FlashDecoding), GQA-aware: one program per kv-head group;
a KV prefix shared by several requests (SharedPrefix) is read once per block of them (cascade);
a sliding window walks (and splits) only the window's keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .arrivals import arrival_counters
from .attend import LOG2E, _attend, fp8_v_staging, fp16_dots
from .common import FLOATS, FP8_KV, FP8_MAX, INDEX_DTYPES, check_tensor, kv_dtypes
from .l2 import L2Prefetch, prefetch_l2_part
from .rotary import _rope_neox, _to_pool
from .shared_prefix import SharedPrefix, shared_prefix_splits
from .splits import _decode_reduce_kernel, _merge_group, _split_range

MERGE_MAX_SPLITS = 32  # sum_here merges up to this many splits (see decode_attention)


class DecodeRope(NamedTuple):
    """The step's new tokens for a decode launch that rotates q and k itself (neox halves over
    whole heads, as rotary_embedding with is_neox) and stores the new k and v into the pool
    before its walk reads them: the separate rotary + store launch folded in."""

    positions: torch.Tensor  # [B] int: each request's new token's position
    cos_sin: torch.Tensor  # [P, D] float32 (rotary.cos_sin_cache; rotary dim = head dim)
    k: torch.Tensor  # [B, Hkv, D] the new tokens' k, not rotated (q's dtype)
    v: torch.Tensor  # [B, Hkv, D]
    loc: torch.Tensor  # [B] int: their slots (req_to_token[req_rows[b], seq_lens[b] - 1]; with
    # the plan's slot_map, full-pool slots: the kernel stores at slot_map[loc], as it reads)


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
    Slot_map,  # (when HAS_MAP) [num_full_slots] int64: req_to_token's slots -> K_buf/V_buf rows
    Counters,  # [B * Hkv] int32 arrivals per (request, kv head), zeros (SUM_HERE)
    Prefetch,  # uint8 (when PREFETCH): bytes the programs ask the L2 for, the next kernel's
    prefetch_bytes,
    qk_scale,  # softmax scale * log2(e)
    window,  # (when HAS_WINDOW) the query at seq_len - 1 sees keys [seq_len - window, seq_len)
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
    HAS_WINDOW: tl.constexpr,  # (not with HAS_KV_STARTS) the walk starts at the window's start
    V_STAGED: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: merge the prefix's columns (if any) here and write Out
    SUM_HERE: tl.constexpr,  # (not DIRECT, nor HAS_KV_STARTS) the last split to arrive merges
    BLOCK_S: tl.constexpr,  # (SUM_HERE) >= num_splits
    ROPE: tl.constexpr,  # rotate q and the new k here (neox halves, whole heads); store k, v
    SATURATE: tl.constexpr,  # (ROPE) clamp to +-SATURATE before the pool's cast (fp8), if > 0
    PREFETCH: tl.constexpr,  # the programs ask the L2 for Prefetch's bytes after their walk
    HAS_MAP: tl.constexpr,  # keys (and ROPE's store) at Slot_map[slot]: a hybrid pool's SWA rows
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(Req_rows + b).to(tl.int64)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    kv_start = 0  # the first key of this request's own walk: its splits divide [kv_start, seq_len)
    if HAS_KV_STARTS:
        kv_start = tl.load(Kv_starts + b).to(tl.int32)
    if HAS_WINDOW:  # NOTE: keys before the window are never read, not just masked
        kv_start = tl.maximum(seq_len - window, 0)
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
        if kv_start + end == seq_len and end > start:  # this split walks the new key: store it
            slot = tl.load(Loc + b).to(tl.int64)
            if HAS_MAP:
                slot = tl.load(Slot_map + slot).to(tl.int64)
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
            BLOCK_H, D, BLOCK_D, BLOCK_N, DOT_PRECISION, FP16_DOTS, V_STAGED, Slot_map, HAS_MAP,
        )  # fmt: skip
        if PREFETCH:
            part = (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split
            parts = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
            prefetch_l2_part(Prefetch, prefetch_bytes, part, parts, 256)
        if not DIRECT:
            o_ptrs = Part_o + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
            tl.store(o_ptrs + offs_d[None, :], acc / l_i[:, None], mask=hd_mask)
            lse_ptrs = Part_lse + b * stride_lb + heads * stride_lh + split
            tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=h_mask)
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


@dataclass(frozen=True)
class DecodePlan:
    """How one decode_attention call runs: its KV split count, the launch's tiling where it
    overrides the defaults, and what the call does besides attending.

    - `partials`: a workspace (float32 [B', H, S', D] and [B', H, S'] with B' >= B, S' >=
      num_kv_splits + shared.num_splits) so that CUDA-graph replays reuse one buffer.
    - `shared` and `kv_starts` (together): request b walks only [kv_starts[b], seq_lens[b])
      itself; where kv_starts[b] > 0, b is a member of exactly one block of `shared` whose
      block_lens equals kv_starts[b] (same slots: the caller guarantees both), and that block's
      programs supply keys [0, kv_starts[b]).
    - `rope` (not with `shared`): q is not rotated yet, nor is the new k, and neither k nor v is
      in the pool: each program rotates its q heads, and the program whose split ends at the new
      key rotates it and stores it and its v at `rope.loc` first (cast as store_kv casts).
    - `l2_prefetch` (CUDA; ignored by the interpreter): after their walk the programs ask the L2
      for those bytes, each its share, for the kernel that runs next (a small decode leaves HBM
      mostly idle; the o_proj weight is the next kernel's read).
    - `window` (not with `shared`): a sliding window of that many keys (>= 1), HF's convention:
      request b's query (position seq_lens[b] - 1) sees only keys at positions >= seq_lens[b] -
      window. Its walk starts at the window's first key: keys before it are never read, and the
      splits divide the window (a split count fitted to min(window, context) fills the SMs).
    - `slot_map` (not with `shared`): the pool's buffers are indexed by other slots than
      req_to_token's (a hybrid pool's windowed layer: its SWA slots, `full_to_swa`): key j of
      request b is at row slot_map[req_to_token[req_rows[b], j]], and `rope` stores at
      slot_map[rope.loc]. Read on the device at each launch: a CUDA graph follows in-place
      updates of the map.
    - `block_n`, `num_warps`, `num_stages` override the per-request kernel's launch (SharedPrefix
      carries the prefix kernel's); `fp8_v_staged` (an fp8 pool under a 16-bit q; CUDA only, the
      default there) converts V tiles before their layout change (`_attend`); False sinks the
      conversion into the dot operand.
    """

    num_kv_splits: int
    partials: tuple[torch.Tensor, torch.Tensor] | None = None
    shared: SharedPrefix | None = None
    kv_starts: torch.Tensor | None = None  # [B] int
    rope: DecodeRope | None = None
    l2_prefetch: L2Prefetch | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    fp8_v_staged: bool | None = None
    window: int | None = None
    slot_map: torch.Tensor | None = None  # [num_full_slots] int64

    def __post_init__(self) -> None:
        if self.num_kv_splits < 1:
            raise ValueError(f"DecodePlan: num_kv_splits must be >= 1, got {self.num_kv_splits}")
        if (self.kv_starts is None) != (self.shared is None):
            raise ValueError("DecodePlan: kv_starts and shared go together (both or neither)")
        if self.rope is not None and self.shared is not None:
            raise ValueError("DecodePlan: rope cannot go with shared (the prefix kernel reads q)")
        if self.window is not None and self.window < 1:
            raise ValueError(f"DecodePlan: window must be None or >= 1, got {self.window}")
        if self.window is not None and self.shared is not None:
            # NOTE: a member's window starts at its own length, so one walk of the prefix for the
            # whole block cannot serve it: a windowed layer decodes without the grouping
            raise ValueError("DecodePlan: window cannot go with shared (a windowed layer is alone)")
        if self.slot_map is not None and self.shared is not None:
            raise ValueError("DecodePlan: slot_map cannot go with shared (its kernel maps none)")
        if self.block_n is not None and self.block_n < 16:
            raise ValueError(f"DecodePlan: block_n must be >= 16, got {self.block_n}")


def decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_rows: torch.Tensor,  # [B] int
    seq_lens: torch.Tensor,  # [B] int, KV length including this step's token (already stored)
    out: torch.Tensor,  # [B, H, D], written
    scale: float,
    plan: DecodePlan,
) -> torch.Tensor:
    """Attention of each request's one query over its whole paged KV (with `plan.window`, its
    last min(window, seq_lens[b]) keys); returns `out`.

    Request b's keys are the slots req_to_token[req_rows[b], :seq_lens[b]] (with `plan.shared`,
    from kv_starts[b] on); q head h reads kv head h // (H / Hkv). A program serves one (request,
    kv head, split) and all q heads of its group. With 2..MERGE_MAX_SPLITS splits and nothing
    shared, the last program of a (request, kv head) to finish its split merges the group's
    partial results itself (kernels/arrivals.py); otherwise a reduce kernel does.

    No host sync: lengths stay on the device, grids depend only on shapes, and splits past a
    walk's length are skipped by both stages. With one split there is no reduce: the split kernel
    merges the shared prefix's columns (if any) and writes `out` itself; without `shared`,
    `plan.partials` is not used.
    """
    bsz, heads, dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    dev = q.device
    check_tensor(q, "q", (bsz, heads, dim), FLOATS, dev)
    check_tensor(k_buffer, "k_buffer", (None, num_kv_heads, dim), kv_dtypes(q.dtype), dev)
    check_tensor(v_buffer, "v_buffer", tuple(k_buffer.shape), (k_buffer.dtype,), dev)
    check_tensor(req_to_token, "req_to_token", (None, None), INDEX_DTYPES, dev)
    check_tensor(req_rows, "req_rows", (bsz,), INDEX_DTYPES, dev)
    check_tensor(seq_lens, "seq_lens", (bsz,), INDEX_DTYPES, dev)
    check_tensor(out, "out", (bsz, heads, dim), (q.dtype,), dev)
    assert heads % num_kv_heads == 0, f"{heads} q heads do not group over {num_kv_heads} kv heads"
    fp32 = q.dtype == torch.float32
    splits, shared, kv_starts, rope = plan.num_kv_splits, plan.shared, plan.kv_starts, plan.rope
    window = 0 if plan.window is None else plan.window  # NOTE: 0 is not read (no HAS_WINDOW)
    v_staged = fp8_v_staging(q, k_buffer) if plan.fp8_v_staged is None else plan.fp8_v_staged
    if v_staged and not fp8_v_staging(q, k_buffer):
        raise ValueError("decode_attention: fp8_v_staged needs an fp8 pool, a 16-bit q, CUDA")
    # NOTE: float32 tiles are halved: at 64 keys the fp32 (FMA) dot spills on sm_90 (ptxas report)
    # an fp8 pool: 128 keys per tile keep a tile's bytes those of 64 bf16 keys (measured best)
    default_n = 32 if fp32 else 128 if k_buffer.element_size() == 1 else 64
    own_launch: tuple[int | None, int | None, int | None] = (None, None, None)
    if shared is not None and k_buffer.element_size() == 1 and not fp32:
        # NOTE: the members' own keys behind a shared prefix are few (the prefix-sharing run:
        # 129-384): 32-key tiles under 2 warps, many programs per SM (measured on the H200 with
        # `benchmarks/kernel.py shared --fp8 --own 160 --launches` (and --own 384): both kernels
        # 353 -> 280 us at 160 own keys, 440 -> 425 us at 384)
        own_launch = (32, 2, 2)
    block_n = plan.block_n or own_launch[0] or default_n
    num_warps = plan.num_warps or own_launch[1]
    num_stages = plan.num_stages or own_launch[2]
    prefix_splits, prefix_block_n = 0, 16  # nothing shared: the reduce reads no prefix column
    if shared is not None:
        assert kv_starts is not None
        check_tensor(kv_starts, "kv_starts", (bsz,), INDEX_DTYPES, dev)
        for name in ("block_members", "block_rows", "block_lens"):
            t = getattr(shared, name)
            check_tensor(t, name, tuple(t.shape), INDEX_DTYPES, dev)
        prefix_splits, prefix_block_n = shared.num_splits, shared.block_n or default_n
    positions, cos_sin, k_new, v_new, loc = (seq_lens, q, q, q, seq_lens) if rope is None else rope
    if rope is not None:  # NOTE: else the five above are not read
        check_tensor(positions, "rope.positions", (bsz,), INDEX_DTYPES, dev)
        check_tensor(cos_sin, "rope.cos_sin", (None, dim), (torch.float32,), dev)
        check_tensor(k_new, "rope.k", (bsz, num_kv_heads, dim), (q.dtype,), dev)
        check_tensor(v_new, "rope.v", (bsz, num_kv_heads, dim), (q.dtype,), dev)
        check_tensor(loc, "rope.loc", (bsz,), INDEX_DTYPES, dev)
        assert dim % 2 == 0, f"rotary halves need an even head dim, got {dim}"
    slot_map = seq_lens if plan.slot_map is None else plan.slot_map  # NOTE: else not read
    if plan.slot_map is not None:
        check_tensor(slot_map, "slot_map", (None,), (torch.int64,), dev)
    if bsz == 0:
        return out
    width = splits + prefix_splits
    # one split: the split kernel writes `out`, after merging the prefix kernel's columns if any
    direct = splits == 1
    if direct and shared is None:
        part_o, part_lse = out, out  # NOTE: not read: nothing to merge
    elif plan.partials is None:
        part_o = torch.empty(bsz, heads, width, dim, dtype=torch.float32, device=dev)
        part_lse = torch.empty(bsz, heads, width, dtype=torch.float32, device=dev)
    else:
        part_o, part_lse = plan.partials
        check_tensor(part_o, "partials[0]", (None, heads, None, dim), (torch.float32,), dev)
        check_tensor(part_lse, "partials[1]", (None, heads, None), (torch.float32,), dev)
        assert part_o.shape[0] >= bsz and part_o.shape[2] >= width, (part_o.shape, width)
        assert part_lse.shape[:3] == part_o.shape[:3], (part_lse.shape, part_o.shape)

    group = heads // num_kv_heads
    block_d = triton.next_power_of_2(dim)
    hint = plan.l2_prefetch if plan.l2_prefetch is not None and dev.type == "cuda" else None
    prefetch_base = seq_lens if hint is None else hint.base()  # NOTE: not read without a hint
    starts = seq_lens if kv_starts is None else kv_starts  # not read without kv_starts
    counters = None
    # NOTE: the merge holds a kv head's [G, splits, D] float32 columns at once: at 64 splits
    # that spills (255 registers and a 240-byte stack on sm_90, bf16 at 4 warps), so more
    # splits than MERGE_MAX_SPLITS take the reduce launch
    if not direct and shared is None and splits <= MERGE_MAX_SPLITS:
        counters = arrival_counters(dev, "decode", bsz * num_kv_heads)
    if shared is not None:  # NOTE: first, so that a direct split kernel can merge its columns
        shared_prefix_splits(q, k_buffer, v_buffer, req_to_token, shared, (part_o, part_lse),
                             scale, splits, prefix_block_n)  # fmt: skip
    _decode_split_kernel[(bsz, num_kv_heads, splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, seq_lens, starts, part_o, part_lse, out,
        positions, cos_sin, k_new, v_new, loc, slot_map, seq_lens if counters is None else counters,
        prefetch_base, prefetch_base.numel(), scale * LOG2E, window, splits,
        max(prefix_splits, 1), splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if part_o.dim() == 4 else 0,
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        G=group, D=dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, PREFIX_BLOCK_N=prefix_block_n, DOT_PRECISION="ieee" if fp32 else "tf32",
        FP16_DOTS=fp16_dots(q, k_buffer), HAS_KV_STARTS=kv_starts is not None,
        HAS_WINDOW=plan.window is not None, V_STAGED=v_staged, DIRECT=direct,
        SUM_HERE=counters is not None, BLOCK_S=triton.next_power_of_2(splits), ROPE=rope is not None,
        SATURATE=FP8_MAX if rope is not None and k_buffer.dtype == FP8_KV else 0.0,
        PREFETCH=hint is not None, HAS_MAP=plan.slot_map is not None,
        num_warps=num_warps or (8 if fp32 else 4), num_stages=num_stages or (2 if fp32 else 3),
    )  # fmt: skip
    if direct or counters is not None:
        return out
    _decode_reduce_kernel[(bsz, heads)](
        part_o, part_lse, seq_lens, starts, out, window, splits, max(prefix_splits, 1), splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        D=dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits + prefix_splits),
        BLOCK_N=block_n, PREFIX_BLOCK_N=prefix_block_n, HAS_KV_STARTS=kv_starts is not None,
        HAS_WINDOW=plan.window is not None, num_warps=4 if width * block_d <= 4096 else 8,
    )  # fmt: skip
    return out
