"""RMSNorm, fused residual-add + RMSNorm (one program per row) and per-head QK-norm in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import FLOATS, check_tensor, supports_pdl

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(  # type: ignore[no-untyped-def]
    X,  # [T, N] input (and, fused, the output)
    Res,  # [T, N] residual stream (fused only), updated in place
    W,  # [N]
    Y,  # [T, N] output
    stride_x,
    stride_r,
    stride_y,
    N,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent: the next kernel may launch now
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the sum is rounded to the residual's dtype and normalised as stored, as `x = x + f(x)` is
        h = (x + r).to(Res.dtype.element_ty)
        tl.store(Res + row * stride_r + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    # normalise, round to the input's dtype, then scale: the order of weft's RMSNorm module
    y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block < 2048 else 8 if block < 8192 else 16


def rmsnorm(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    out: torch.Tensor | None = None,  # [T, N], x's dtype; may be x itself
    pdl: bool = False,
) -> torch.Tensor:
    """out = weight * (x / sqrt(mean(x^2) + eps)), computed in float32; returns out."""
    tokens, hidden = x.shape
    check_tensor(x, "x", (tokens, hidden), FLOATS)
    check_tensor(weight, "weight", (hidden,), FLOATS, x.device)
    out = torch.empty_like(x) if out is None else out
    check_tensor(out, "out", (tokens, hidden), (x.dtype,), x.device)
    assert hidden <= MAX_HIDDEN, f"hidden size {hidden} > {MAX_HIDDEN} (one block per row)"
    if tokens:
        block = triton.next_power_of_2(hidden)
        pdl = pdl and supports_pdl(x.device)
        _rmsnorm_kernel[(tokens,)](
            x, x, weight, out, x.stride(0), x.stride(0), out.stride(0), hidden, eps,
            BLOCK=block, HAS_RESIDUAL=False, num_warps=_num_warps(block), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,  # [T, N] a sublayer's output; overwritten with the normalised sum
    residual: torch.Tensor,  # [T, N] the residual stream; overwritten with x + residual
    weight: torch.Tensor,  # [N]
    eps: float,
    pdl: bool = False,
) -> None:
    """In place: residual <- x + residual; x <- rmsnorm(residual) * weight.

    The model's `h = h + attn(norm1(h)); h = h + mlp(norm2(h))` becomes, with h carried as
    `residual`:  x = attn(x); fused_add_rmsnorm(x, residual, w2, eps); x = mlp(x); ...
    The sum is rounded to residual's dtype before normalising, so x and residual hold exactly what
    the unfused `h = x + h; rmsnorm(h)` would (up to the float32 reduction order).
    """
    tokens, hidden = x.shape
    check_tensor(x, "x", (tokens, hidden), FLOATS)
    check_tensor(residual, "residual", (tokens, hidden), (x.dtype,), x.device)
    check_tensor(weight, "weight", (hidden,), FLOATS, x.device)
    assert hidden <= MAX_HIDDEN, f"hidden size {hidden} > {MAX_HIDDEN} (one block per row)"
    if tokens:
        block = triton.next_power_of_2(hidden)
        pdl = pdl and supports_pdl(x.device)
        _rmsnorm_kernel[(tokens,)](
            x, residual, weight, x, x.stride(0), residual.stride(0), x.stride(0), hidden, eps,
            BLOCK=block, HAS_RESIDUAL=True, num_warps=_num_warps(block), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip


@triton.jit
def _heads_rmsnorm_kernel(  # type: ignore[no-untyped-def]
    Q,  # [T, HQ, D] (any row and head strides), normalised in place
    K,  # [T, HK, D], likewise
    WQ,  # [D]
    WK,  # [D]
    HQ,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    D,
    eps,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    if head < HQ:
        ptrs = Q + token * stride_qt + head * stride_qh + offs
        w = tl.load(WQ + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        ptrs = K + token * stride_kt + (head - HQ) * stride_kh + offs
        w = tl.load(WK + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    # as _rmsnorm_kernel: normalise, round to the input's dtype, then scale
    y = (x * rstd).to(Q.dtype.element_ty).to(tl.float32) * w
    tl.store(ptrs, y.to(Q.dtype.element_ty), mask=mask)


def heads_rmsnorm_(
    q: torch.Tensor,  # [T, HQ, D]: views into a fused QKV output are fine (unit stride in D)
    k: torch.Tensor,  # [T, HK, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's QK-norm in one launch, in place: every head vector of q and of k through rmsnorm
    with its own weight (exactly what rmsnorm computes per row: the same block and warps, so
    the same float32 reduction order); returns (q, k). Strided views
    are normalised where they lie, without the copies that flattening them would make."""
    tokens, q_heads, dim = q.shape
    check_tensor(q, "q", (tokens, q_heads, dim), FLOATS)
    check_tensor(k, "k", (tokens, None, dim), (q.dtype,), q.device)
    check_tensor(q_weight, "q_weight", (dim,), FLOATS, q.device)
    check_tensor(k_weight, "k_weight", (dim,), FLOATS, q.device)
    assert dim <= MAX_HIDDEN, f"head dim {dim} > {MAX_HIDDEN}"
    if tokens:
        block = triton.next_power_of_2(dim)
        _heads_rmsnorm_kernel[(tokens, q_heads + k.shape[1])](
            q, k, q_weight, k_weight, q_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            dim, eps, BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return q, k
