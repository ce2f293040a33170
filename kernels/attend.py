"""The online-softmax walk of query rows over paged keys, shared by the decode, shared-prefix and
extend kernels, and the fp8 -> float16 conversion."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# NOTE: partial results are kept in base 2 (scores scaled by log2(e)), so the kernels use exp2/log2.
LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_to_f16_here(x):  # type: ignore[no-untyped-def]
    """e4m3 -> float16 by the hardware instruction (sm_89+; CUDA only), 4 values per call, in
    the layout x was loaded in: as an opaque (impure) op the compiler cannot sink the conversion
    into the dot's operand layout (see `_attend`)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
    )  # fmt: skip


@triton.jit
def _attend(  # type: ignore[no-untyped-def]
    q,  # [BLOCK_R, BLOCK_D] query rows, all served by kv head kvh
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Tokens,  # a req_to_token row
    start,
    end,
    kvh,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    BLOCK_R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # an fp8 pool under a 16-bit q: both dots in float16
    V_STAGED: tl.constexpr,  # with FP16_DOTS: V converted before its layout change (CUDA)
    Slot_map=None,  # (when HAS_MAP) [num_full_slots] int64: a Tokens slot -> its K_buf/V_buf row
    HAS_MAP: tl.constexpr = False,
):
    """Online softmax of q over the keys at slots Tokens[start:end] (with HAS_MAP, at
    Slot_map[Tokens[start:end]]: a hybrid pool's windowed layer): (acc, row max, row sum).

    NOTE: with FP16_DOTS (an fp8 pool under a 16-bit q) both dots run in float16: e4m3 ->
    float16 is one instruction per two values on sm_89+, e4m3 -> bfloat16 takes more. At batch
    512, kv 1536 on an fp8 pool: 697 -> 636 us (block_n 128; 907.8 us at the old block_n 64),
    60% of the copy ceiling; moving the bits with integer ops instead: 868 us (`benchmarks/kernel.py
    decode --fp8 --batches 512`). Every e4m3 value is exact in float16; a bf16 q loses range beyond 65504.
    NOTE: V_STAGED: a V tile is the dot's second operand with its rows (keys) as the reduction,
    and mma wants consecutive keys per register; ldmatrix.trans transposes 16-bit tiles, nothing
    transposes 8-bit ones, so a conversion sunk into the operand reads V byte by byte (128
    ld.shared.b8 per thread per tile: the PTX, `git show 0405bc0:benchmarks/ptx_loop.py`). Converted where loaded, V goes
    through shared memory as float16 and ldmatrix.trans: at batch 512, kv 1536, 632 -> 506 us,
    61% -> 76% of copy (FlashInfer's fp8 decode: 679 us; `benchmarks/kernel.py decode --fp8`).
    NOTE: transposing both dots (K q^T and V^T p^T, so their rows are 64-128 keys or dims and
    Hopper's wgmma applies instead of mma.sync) was slower at every batch and launch tried:
    batch 64, kv 2048, bf16: 130.8 us plain vs 164.0 us; batch 512, kv 1536, fp8: 487.9 vs
    581.2 us (`benchmarks/kernel.py decode`; the transposed code is in commit ee312c3).
    """
    if FP16_DOTS:
        q = q.to(tl.float16)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        slot = tl.load(Tokens + n, mask=n_mask, other=0).to(tl.int64)
        if HAS_MAP:
            slot = tl.load(Slot_map + slot, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = K_buf + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D] (fp8 up)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_R, N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_R, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V_buf + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if V_STAGED:
            v = _e4m3_to_f16_here(v)
        else:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def fp16_dots(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether the kernels take an fp8 pool's dots in float16 (see `_attend`)."""
    return k_buffer.element_size() == 1 and q.dtype != torch.float32


def fp8_v_staging(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    """Whether an fp8 pool's V tiles can be converted where they are loaded (`_attend`): the
    conversion is inline PTX, so CUDA only (the interpreter sinks it into the dot as before)."""
    return fp16_dots(q, k_buffer) and q.is_cuda
