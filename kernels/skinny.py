"""Skinny projections: y = x @ W^T (+ bias) for a few rows of x, reading W once at copy speed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._check import check_tensor

MAX_ROWS = 4  # rows of x one launch serves: each weight is read once for all of them


@dataclass(frozen=True)
class GemvLaunch:
    """One launch's tiling: BLOCK_N output columns (rows of W) per program, K walked BLOCK_K at
    a time, and num_warps. The products are summed over K per thread and reduced once at the end,
    so a program holds rows x block_n x block_k float32 partial sums."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of 2, got {value}")


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K] (or [M, 2K]: gate then up, with SILU_MUL)
    W,  # [N, K]
    Bias,  # [N] (when HAS_BIAS)
    Y,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: W's loads need no mask
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x = silu(gate) * up, rounded to W's dtype as silu_and_mul does
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = X + offs_m[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x_mask = m_mask[:, None] & k_mask[None, :]
        if SILU_MUL:
            gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
            x = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [M, N]
    launch: GemvLaunch | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, rounded once, for M <= MAX_ROWS rows; returns out.

    With `silu_mul`, x holds a gated MLP's [gate | up] and the product is taken with
    silu(gate) * up (each value rounded to weight's dtype first, as `silu_and_mul` stores it):
    the down projection without the activation's own launch."""
    rows, width = x.shape
    n, k = weight.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {rows}")
    if width != (2 * k if silu_mul else k):
        raise ValueError(f"x has {width} columns; weight [{n}, {k}] wants "
                         f"{2 * k if silu_mul else k}{' (gate | up)' if silu_mul else ''}")  # fmt: skip
    floats = (torch.float16, torch.bfloat16, torch.float32)
    check_tensor(weight, "weight", (n, k), floats)
    assert weight.is_contiguous(), "gemv: weight must be contiguous"
    check_tensor(x, "x", (rows, width), (weight.dtype,), weight.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), (weight.dtype,), weight.device)
    if out is None:
        out = torch.empty(rows, n, dtype=weight.dtype, device=weight.device)
    check_tensor(out, "out", (rows, n), (weight.dtype,), weight.device)
    launch = launch or GemvLaunch()
    block_m = triton.next_power_of_2(rows)
    _gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        EVEN=n % launch.block_n == 0 and k % launch.block_k == 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, num_warps=launch.num_warps,
    )  # fmt: skip
    return out
