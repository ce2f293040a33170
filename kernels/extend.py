"""Extend (prefill) attention: new tokens attend to their cached prefix in the pool, then causally to
each other (within a sliding window, if any); ragged batches, any page size, GQA (packed: a kv
head's q heads in one program). Over an fp8 pool the new tokens' K/V are read back from the pool
too (quantized, as decode sees them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attend import LOG2E, _e4m3_to_f16_here, fp8_v_staging, fp16_dots
from .common import FLOATS, FP8_KV, INDEX_DTYPES, check_tensor, kv_dtypes


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]
    Q,  # [T, H, D] new tokens' queries, request after request
    K,  # [T, Hkv, D] new tokens' keys
    V,  # [T, Hkv, D]
    K_buf,  # [num_slots, Hkv, D] the pool: each request's prefix
    V_buf,
    Req_to_token,  # [max_reqs, max_context]
    Req_rows,  # [B]
    Prefix_lens,  # [B]
    Extend_lens,  # [B]
    Extend_start,  # [B] first row of each request in Q/K/V/Out
    Work,  # [W, 2] int32 (request, query block) per program (when HAS_WORK)
    Slot_map,  # (when HAS_MAP) [num_full_slots] int64: req_to_token's slots -> K_buf/V_buf rows
    Out,  # [T, H, D]
    qk_scale,  # softmax scale * log2(e)
    window,  # (when HAS_WINDOW) the query at position p sees keys at positions > p - window
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_rr,
    stride_ot,
    stride_oh,
    G: tl.constexpr,  # q heads per kv head
    PACK: tl.constexpr,  # q heads per program: G (GQA-packed, one kv head's) or 1
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_M // PACK new tokens x PACK heads
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # an fp8 pool under a 16-bit q: the prefix's dots in float16
    V_STAGED: tl.constexpr,  # the prefix's V tiles converted where loaded (attend.py's `_attend`)
    HAS_WORK: tl.constexpr,  # a 1-D grid over (Work item, head group); else (B, H / PACK, blocks)
    HEAD_GROUPS: tl.constexpr,  # H / PACK
    NEW_FROM_POOL: tl.constexpr,  # the new tokens' K/V read from the pool (an fp8 pool), not K/V
    HAS_WINDOW: tl.constexpr,
    HAS_MAP: tl.constexpr,  # the pool's rows at Slot_map[slot] (a hybrid pool's windowed layer)
):
    # One program: q heads hp*PACK .. hp*PACK+PACK-1 (kv head kvh's when packed) over
    # BLOCK_T = BLOCK_M // PACK new tokens of request b; each K/V tile is loaded once for them all.
    #
    #   query row r:  new token m_blk*BLOCK_T + r // PACK,  q head hp*PACK + r % PACK
    #   keys of request b:  [ prefix (pool, via req_to_token) | new 0 .. ext-1 (K/V; the pool's
    #                                                             slots prefix+0.. if NEW_FROM_POOL) ]
    #   new token i (i < ext):   sees all prefix keys              sees new keys 0..i
    #   with HAS_WINDOW, only keys at positions > prefix + i - window: each stage's walk starts at
    #   the window of the program's first token (keys before it are never read), and masks per row
    if HAS_WORK:
        w = tl.program_id(0) // HEAD_GROUPS
        hp = tl.program_id(0) % HEAD_GROUPS
        b = tl.load(Work + 2 * w)
        m_blk = tl.load(Work + 2 * w + 1)
    else:
        b = tl.program_id(0)
        hp = tl.program_id(1)
        m_blk = tl.program_id(2)
    BLOCK_T: tl.constexpr = BLOCK_M // PACK
    ext_len = tl.load(Extend_lens + b).to(tl.int32)
    if m_blk * BLOCK_T < ext_len:
        kvh = hp * PACK // G
        row = tl.load(Req_rows + b).to(tl.int64)
        prefix = tl.load(Prefix_lens + b).to(tl.int32)
        first = tl.load(Extend_start + b).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_M)
        tok = m_blk * BLOCK_T + offs_r // PACK  # [M] index among the new tokens
        head = hp * PACK + offs_r % PACK  # [M] q head
        # NOTE: a G that is no power of 2 leaves BLOCK_M % G rows of no token at the end
        r_mask = (tok < ext_len) & (offs_r < BLOCK_T * PACK)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        rd_mask = r_mask[:, None] & d_mask[None, :]
        t_rows = first + tok  # [M] each query's row in Q and Out
        q_ptrs = Q + t_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=rd_mask, other=0.0)  # [M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # stage 1: the cached prefix, read through req_to_token (no causal mask needed)
        q1 = q
        if FP16_DOTS:
            q1 = q.to(tl.float16)
        # the first key each row may see, as a position (the prefix's keys are 0..prefix-1)
        lowest = tl.zeros([BLOCK_M], tl.int32)
        lo = 0
        if HAS_WINDOW:
            lowest = prefix + tok - window + 1  # [M]
            lo = tl.maximum(prefix + m_blk * BLOCK_T - window + 1, 0)
        for n0 in range(lo, prefix, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < prefix
            kv_mask = n_mask[:, None] & d_mask[None, :]
            slot = tl.load(Req_to_token + row * stride_rr + n, mask=n_mask, other=0).to(tl.int64)
            if HAS_MAP:
                slot = tl.load(Slot_map + slot, mask=n_mask, other=0).to(tl.int64)
            k_ptrs = K_buf + slot[:, None] * stride_kbt + kvh * stride_kbh + offs_d[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q1.dtype)  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q1, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
            seen = n_mask[None, :]
            if HAS_WINDOW:
                seen = seen & (n[None, :] >= lowest[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            if HAS_WINDOW:  # a row may see no key of this tile, nor any before it
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_ptrs = V_buf + slot[:, None] * stride_vbt + kvh * stride_vbh + offs_d[None, :]
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            if V_STAGED:
                v = _e4m3_to_f16_here(v)
            else:
                v = v.to(q1.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # stage 2: the new tokens themselves, causal by each row's token; blocks past this
        # program's tokens are skipped. NEW_FROM_POOL: from the slots the caller stored them in
        # (quantized), read and converted as stage 1 reads the prefix
        end = tl.minimum(ext_len, (m_blk + 1) * BLOCK_T)
        q2 = q
        if NEW_FROM_POOL:
            q2 = q1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(m_blk * BLOCK_T - window + 1, 0)
        for n0 in range(lo, end, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < end
            kv_mask = n_mask[:, None] & d_mask[None, :]
            if NEW_FROM_POOL:
                slot = tl.load(Req_to_token + row * stride_rr + prefix + n, mask=n_mask, other=0)
                slot = slot.to(tl.int64)
                if HAS_MAP:
                    slot = tl.load(Slot_map + slot, mask=n_mask, other=0).to(tl.int64)
                k_ptrs = K_buf + slot[:, None] * stride_kbt + kvh * stride_kbh + offs_d[None, :]
                v_ptrs = V_buf + slot[:, None] * stride_vbt + kvh * stride_vbh + offs_d[None, :]
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q2.dtype)
            else:
                k_ptrs = K + (first + n)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
                v_ptrs = V + (first + n)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            s = tl.dot(q2, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            seen = n_mask[None, :] & (n[None, :] <= tok[:, None])
            if HAS_WINDOW:
                seen = seen & (prefix + n[None, :] >= lowest[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            if HAS_WINDOW:
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            if NEW_FROM_POOL:
                if V_STAGED:
                    v = _e4m3_to_f16_here(v)
                else:
                    v = v.to(q2.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        o_ptrs = Out + t_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc / l_i[:, None], mask=rd_mask)


def extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] the new tokens' keys (also stored to the pool by the caller)
    v: torch.Tensor,  # [T, Hkv, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_rows: torch.Tensor,  # [B] int
    prefix_lens: torch.Tensor,  # [B] int, tokens already in the pool before this step
    extend_lens: torch.Tensor,  # [B] int, new tokens this step (0 allowed)
    extend_start_loc: torch.Tensor,  # [B] int, exclusive cumsum of extend_lens
    out: torch.Tensor,  # [T, H, D], written
    scale: float,
    max_extend_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    pack_gqa: bool = False,
    work: torch.Tensor | None = None,
    window: int | None = None,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over prefix + new tokens; returns `out`.

    Request b's new tokens are rows extend_start_loc[b] + [0, extend_lens[b]) of q/k/v/out; its
    prefix keys are the slots req_to_token[req_rows[b], :prefix_lens[b]]. New token i (position
    prefix + i) sees the whole prefix and new tokens 0..i. q head h reads kv head h // (H / Hkv).
    A sliding `window` (>= 1; HF's convention) keeps only the keys at positions > prefix + i -
    window; a query block's walk starts at its first token's window (no read before it).

    Over an fp8 pool the new tokens' keys and values are read from their slots
    req_to_token[req_rows[b], prefix_lens[b] + i], where the caller has stored them: a token then
    attends to the same quantized K/V whichever step computes it (a prompt in one chunk or two,
    over a cached prefix or not, an extend or a decode), as the torch and flashinfer backends and
    vLLM's paged prefill do; k and v give only their shapes. Over a pool of q's dtype the stored
    values equal k and v, which are read directly (contiguous, no slot lookup).

    `max_extend_len` (>= every extend_lens[b]) sizes the grid; pass it from the CPU copy to avoid a
    device sync. `pack_gqa`: one program serves all H / Hkv q heads of a kv head, so each K/V tile
    is loaded once for them (off by default, see the NOTE below). `block_m` counts query rows:
    new tokens unpacked, (token, head) pairs packed.

    `work` (int32 [W, 2], from `extend_work` with this launch's `extend_block_tokens`): the
    programs run exactly these (request, query block) pairs, in this order, all head groups of
    one pair side by side, instead of a grid of every request x its longest request's blocks,
    whose blocks past a request's new tokens start and exit at once.

    `slot_map` (int64 [num_full_slots]): the pool's buffers are indexed by other slots than
    req_to_token's (a hybrid pool's windowed layer: its SWA slots, `full_to_swa`): every slot
    read from req_to_token (the prefix's; an fp8 pool's new tokens') is looked up in it first.
    """
    tokens, heads, dim = q.shape
    bsz = req_rows.shape[0]
    num_kv_heads = k.shape[1]
    dev = q.device
    check_tensor(q, "q", (tokens, heads, dim), FLOATS, dev)
    check_tensor(k, "k", (tokens, num_kv_heads, dim), (q.dtype,), dev)
    check_tensor(v, "v", (tokens, num_kv_heads, dim), (q.dtype,), dev)
    check_tensor(k_buffer, "k_buffer", (None, num_kv_heads, dim), kv_dtypes(q.dtype), dev)
    check_tensor(v_buffer, "v_buffer", tuple(k_buffer.shape), (k_buffer.dtype,), dev)
    check_tensor(req_to_token, "req_to_token", (None, None), INDEX_DTYPES, dev)
    for name, t in (("req_rows", req_rows), ("prefix_lens", prefix_lens)):
        check_tensor(t, name, (bsz,), INDEX_DTYPES, dev)
    for name, t in (("extend_lens", extend_lens), ("extend_start_loc", extend_start_loc)):
        check_tensor(t, name, (bsz,), INDEX_DTYPES, dev)
    check_tensor(out, "out", (tokens, heads, dim), (q.dtype,), dev)
    if slot_map is not None:
        check_tensor(slot_map, "slot_map", (None,), (torch.int64,), dev)
    assert heads % num_kv_heads == 0, f"{heads} q heads do not group over {num_kv_heads} kv heads"
    assert window is None or window >= 1, f"window must be None or >= 1, got {window}"
    group = heads // num_kv_heads
    fp32 = q.dtype == torch.float32
    # NOTE: float32 tiles are smaller: the fp32 (FMA) dot spills at 32x32 and up on sm_90 (ptxas),
    # and at 32x16 x d 128 under 4 warps (Triton 3.9). Packed, a 16-bit tile is 128 rows (32 tokens
    # x 4 heads) x 64 keys under 8 warps: no spills, 96 KB shared, 230 registers (sm_90), so one
    # program per SM (two would need <= 128 registers: it spills there).
    # NOTE: packing is opt-in: on the H200 it ran at 0.88-0.93x of one program per q head at every
    # shape measured (prefill 8 x 2048, 8 x (1024 + 1024), 64 x (2048 cached + 128), bf16 and fp8
    # pools; `benchmarks/kernel.py extend`, tiles: `--launches`). Unpacked over an fp8 pool, 128 x 128 tiles under 8
    # warps were best (+13-15% over 64 x 64 at 64 x (2048 + 128)); over bf16, 64 x 64 under 4.
    fp8_pool = k_buffer.element_size() == 1 and not fp32
    block_m, block_n = _tiles(fp32, fp8_pool, dim, pack_gqa, block_m, block_n)
    assert block_m >= 16 and block_n >= 16, (block_m, block_n)
    pack = group if pack_gqa else 1
    assert block_m >= pack, f"block_m {block_m} < {group} q heads per kv head: it cannot pack them"
    if work is not None:
        check_tensor(work, "work", (None, 2), (torch.int32,), dev)
        if bsz == 0 or tokens == 0 or work.shape[0] == 0:
            return out
        grid: tuple[int, ...] = (work.shape[0] * (heads // pack),)
    else:
        if max_extend_len is None:
            max_extend_len = int(extend_lens.max()) if bsz else 0
        if bsz == 0 or tokens == 0 or max_extend_len == 0:
            return out
        grid = (bsz, heads // pack, triton.cdiv(max_extend_len, block_m // pack))
    _extend_kernel[grid](
        q, k, v, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, extend_lens,
        extend_start_loc, extend_lens if work is None else work,
        extend_lens if slot_map is None else slot_map, out, scale * LOG2E,
        0 if window is None else window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1),
        G=group, PACK=pack, D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if fp32 else "tf32",
        FP16_DOTS=fp16_dots(q, k_buffer), V_STAGED=fp8_v_staging(q, k_buffer),
        HAS_WORK=work is not None, HEAD_GROUPS=heads // pack,
        NEW_FROM_POOL=k_buffer.dtype == FP8_KV, HAS_WINDOW=window is not None,
        HAS_MAP=slot_map is not None,
        num_warps=num_warps or (8 if block_m * dim >= (32 if fp32 else 128) * 128 else 4),
        num_stages=2,
    )  # fmt: skip
    return out


def _tiles(
    fp32: bool, fp8_pool: bool, dim: int, pack_gqa: bool, block_m: int | None, block_n: int | None
) -> tuple[int, int]:
    """The launch's (block_m, block_n): the given ones, else the defaults (see extend_attention)."""
    if pack_gqa:
        rows, keys = (32 if fp32 else 128 if dim <= 128 else 64), (16 if fp32 else 64)
    else:
        rows = 32 if fp32 else 128 if fp8_pool else 64
        keys = 16 if fp32 else 128 if fp8_pool else 64
    return block_m or rows, block_n or keys


def extend_block_tokens(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    dim: int,
    group: int,
    pack_gqa: bool = False,
    block_m: int | None = None,
) -> int:
    """New tokens per query block of extend_attention's launch with these arguments (what
    `extend_work` needs): block_m rows, of `group` heads each when packed."""
    fp32 = q_dtype == torch.float32
    rows, _ = _tiles(fp32, kv_dtype.itemsize == 1 and not fp32, dim, pack_gqa, block_m, None)
    return rows // (group if pack_gqa else 1)


def extend_work(extend_lens: list[int], prefix_lens: list[int], block_tokens: int) -> list[int]:
    """Every query block with new tokens, flat as [request, block, request, block, ...]: the
    blocks with the most keys to walk first, so the longest programs start first and the last
    wave is short (a stable order: ties keep request order)."""
    items = [
        (prefix + min(n, (m + 1) * block_tokens), b, m)
        for b, (n, prefix) in enumerate(zip(extend_lens, prefix_lens, strict=True))
        for m in range(-(-n // block_tokens))
    ]
    items.sort(key=lambda item: -item[0])
    return [x for _, b, m in items for x in (b, m)]
