"""KV store: write the new tokens' K and V into their slots of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_KV, FP8_MAX, INDEX_DTYPES, check_tensor


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    K,  # [T, Hkv, D]
    V,
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Loc,  # [T] slot of each token
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SATURATE: tl.constexpr,  # > 0: clamp to +-SATURATE before the cast (an fp8 pool)
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < HKV)[:, None] & (offs_d < D)[None, :]
    hd = offs_h[:, None]  # [BLOCK_H, 1]
    k = tl.load(K + t * stride_kt + hd * stride_kh + offs_d[None, :], mask=mask)  # [H, D] blocks
    v = tl.load(V + t * stride_vt + hd * stride_vh + offs_d[None, :], mask=mask)
    if SATURATE > 0:
        k = tl.minimum(tl.maximum(k, -SATURATE), SATURATE)
        v = tl.minimum(tl.maximum(v, -SATURATE), SATURATE)
    kb_ptrs = K_buf + slot * stride_kbt + hd * stride_kbh + offs_d[None, :]
    vb_ptrs = V_buf + slot * stride_vbt + hd * stride_vbh + offs_d[None, :]
    tl.store(kb_ptrs, k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(vb_ptrs, v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D] (row stride free: a view into a fused qkv output is fine)
    v: torch.Tensor,  # [T, Hkv, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D], written at loc
    v_buffer: torch.Tensor,
    loc: torch.Tensor,  # [T] int slots (distinct)
) -> None:
    """In place: k_buffer[loc] = k and v_buffer[loc] = v, cast to the pool's dtype (an fp8 pool
    saturates at +-448 instead of overflowing to NaN)."""
    tokens, num_kv_heads, dim = k.shape
    dev = k.device
    check_tensor(k, "k", (tokens, num_kv_heads, dim), None, dev)
    check_tensor(v, "v", (tokens, num_kv_heads, dim), (k.dtype,), dev)
    check_tensor(k_buffer, "k_buffer", (None, num_kv_heads, dim), None, dev)
    check_tensor(v_buffer, "v_buffer", tuple(k_buffer.shape), (k_buffer.dtype,), dev)
    check_tensor(loc, "loc", (tokens,), INDEX_DTYPES, dev)
    if tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(dim)
    _store_kv_kernel[(tokens,)](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        HKV=num_kv_heads, D=dim, BLOCK_H=block_h, BLOCK_D=block_d,
        SATURATE=FP8_MAX if k_buffer.dtype == FP8_KV else 0.0,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )  # fmt: skip
