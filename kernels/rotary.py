"""Rotary position embedding applied in place to q and k, from a [cos | sin] cache (any scaling)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, FP8_KV, FP8_MAX, INDEX_DTYPES, check_tensor


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, 2 * len(inv_freq)]: cos(p * f) then sin(p * f) for each position p.

    inv_freq [R/2] carries the scaling (linear, Llama 3.1) already, e.g. from
    runtime.models.layers.rope_inv_freq; R is the rotary dim (the head dim for Llama).
    """
    pos = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq.float()[None, :]  # [P, R/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]
    base,  # pointer to head 0, dim 0 of one token
    stride_h,
    cos,  # [BLOCK_HALF] float32
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotates the heads in place; returns the rotated pairs in base's dtype, their dims and
    the mask, for a caller that stores them elsewhere too."""
    offs_i = tl.arange(0, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_HEADS)
    if IS_NEOX:  # pairs (i, i + R/2)
        o1 = offs_i
        o2 = offs_i + HALF
    else:  # pairs (2i, 2i + 1)
        o1 = 2 * offs_i
        o2 = 2 * offs_i + 1
    mask = (offs_h < num_heads)[:, None] & (offs_i < HALF)[None, :]
    p1 = base + offs_h[:, None] * stride_h + o1[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    p2 = base + offs_h[:, None] * stride_h + o2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # NOTE: explicit fma, so the compiler's contraction cannot round these differently from
    # _rope_neox's (the decode kernel's rotation): both paths store the same k bit for bit
    y1 = tl.fma(x1, cos[None, :], -(x2 * sin[None, :])).to(base.dtype.element_ty)
    y2 = tl.fma(x2, cos[None, :], x1 * sin[None, :]).to(base.dtype.element_ty)
    tl.store(p1, y1, mask=mask)
    tl.store(p2, y2, mask=mask)
    return y1, y2, o1, o2, mask


@triton.jit
def _rope_neox(ptrs, offs_d, mask, cos, sin, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """The rows at `ptrs` (dims offs_d of whole heads) rotated by halves (pairs (i, i + HALF)),
    in float32 as _rotate_heads computes them; cos and sin hold each dim's (d mod HALF)."""
    lo = offs_d < HALF
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ptrs + (tl.where(lo, offs_d + HALF, offs_d - HALF) - offs_d), mask=mask, other=0.0)
    xp = tl.where(lo, -xp.to(tl.float32), xp.to(tl.float32))  # the rotated half's sign
    return tl.fma(x, cos, xp * sin)  # as _rotate_heads rounds it (explicit fma in both)


@triton.jit
def _to_pool(x, SATURATE: tl.constexpr, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """As store_kv casts: clamped to +-SATURATE first where it is > 0 (an fp8 pool)."""
    if SATURATE > 0:
        x = tl.minimum(tl.maximum(x, -SATURATE), SATURATE)
    return x.to(dtype)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
    Positions,  # [T]
    Q,  # [T, H, D]
    K,  # [T, Hkv, D]
    Cache,  # [P, R] float32
    V,  # [T, Hkv, D] (STORE only, as the three below)
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Loc,  # [T] slot of each token
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    H,
    HKV,
    HALF: tl.constexpr,  # R / 2
    BLOCK_H: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    STORE: tl.constexpr,  # also write the rotated k and v to the pool (R = D)
    SATURATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(Cache + pos * stride_c + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(Cache + pos * stride_c + HALF + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, cos, sin, H, HALF, BLOCK_H, BLOCK_HALF, IS_NEOX)
    k1, k2, o1, o2, mask = _rotate_heads(
        K + t * stride_kt, stride_kh, cos, sin, HKV, HALF, BLOCK_HKV, BLOCK_HALF, IS_NEOX
    )
    if STORE:
        slot = tl.load(Loc + t).to(tl.int64)
        hd = tl.arange(0, BLOCK_HKV)[:, None]
        kb = K_buf + slot * stride_kbt + hd * stride_kbh
        tl.store(kb + o1[None, :], _to_pool(k1, SATURATE, K_buf.dtype.element_ty), mask=mask)
        tl.store(kb + o2[None, :], _to_pool(k2, SATURATE, K_buf.dtype.element_ty), mask=mask)
        vb = V_buf + slot * stride_vbt + hd * stride_vbh
        v_src = V + t * stride_vt + hd * stride_vh
        v1 = tl.load(v_src + o1[None, :], mask=mask)
        v2 = tl.load(v_src + o2[None, :], mask=mask)
        tl.store(vb + o1[None, :], _to_pool(v1, SATURATE, V_buf.dtype.element_ty), mask=mask)
        tl.store(vb + o2[None, :], _to_pool(v2, SATURATE, V_buf.dtype.element_ty), mask=mask)


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, H, D], rotated in place (row and head strides free)
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos_sin_cache: torch.Tensor,  # [P, R] float32, R <= D even: see cos_sin_cache()
    is_neox: bool = True,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place: rotate the first R dims of every q and k head by its token's position.

    is_neox=True rotates halves (x[i], x[i + R/2]) as Llama/HF `rotate_half` does; False rotates
    interleaved pairs (x[2i], x[2i+1]) as GPT-J does. Dims past R are untouched.

    kv_store = (v, k_buffer, v_buffer, loc) also does store_kv's work in the same launch: the
    rotated k and v go to their slots of the pool, cast as store_kv casts them (R = D only).
    """
    tokens, heads, dim = q.shape
    num_kv_heads = k.shape[1]
    dev = q.device
    check_tensor(positions, "positions", (tokens,), INDEX_DTYPES, dev)
    check_tensor(q, "q", (tokens, heads, dim), FLOATS, dev)
    check_tensor(k, "k", (tokens, num_kv_heads, dim), (q.dtype,), dev)
    check_tensor(cos_sin_cache, "cos_sin_cache", (None, None), (torch.float32,), dev)
    rot = cos_sin_cache.shape[1]
    assert rot % 2 == 0 and rot <= dim, f"rotary dim {rot} must be even and <= head dim {dim}"
    v, k_buf, v_buf, loc = k, k, k, positions  # NOTE: not read unless kv_store is given
    if kv_store is not None:
        v, k_buf, v_buf, loc = kv_store
        if rot != dim:
            raise ValueError(f"rotary_embedding: kv_store needs the rotary dim {rot} = {dim}")
        check_tensor(v, "v", (tokens, num_kv_heads, dim), (q.dtype,), dev)
        check_tensor(k_buf, "k_buffer", (None, num_kv_heads, dim), None, dev)
        check_tensor(v_buf, "v_buffer", tuple(k_buf.shape), (k_buf.dtype,), dev)
        check_tensor(loc, "loc", (tokens,), INDEX_DTYPES, dev)
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](
        positions, q, k, cos_sin_cache, v, k_buf, v_buf, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v.stride(0), v.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        heads, num_kv_heads,
        HALF=rot // 2, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(rot // 2),
        IS_NEOX=is_neox, STORE=kv_store is not None,
        SATURATE=FP8_MAX if kv_store is not None and k_buf.dtype == FP8_KV else 0.0,
        num_warps=4,
    )  # fmt: skip
