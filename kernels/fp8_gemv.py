"""The FP8 skinny GEMV: y = (xq @ W^T) * x_scale * w_scale (+ bias) for 1-32 rows of x, W read
once at fp8 (W8A8): x is quantized per token first (or with a static scale), then an fp8 x fp8 dot
runs straight on the loaded W tiles; both scales on the float32 sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .arrivals import arrival_counters
from .common import FLOATS, check_tensor, supports_pdl
from .fp8 import fp8_linear_ref, quantize_activations
from .skinny import GemvLaunch, _finish, _split_sum_kernel, supports_gemv

MAX_ROWS = 32  # x^T is a dot operand padded to 16 columns (1-16 rows) or 32 (17-32 rows)
FP8 = torch.float8_e4m3fn


@triton.jit
def _fp8_gemv_kernel(  # type: ignore[no-untyped-def]
    XQ,  # [M, K] fp8 e4m3: x quantized
    XS,  # [M] float32 (row stride stride_xs: 0 for a static scale)
    W,  # [N, K] fp8 e4m3
    Scale,  # [N] float32 per-output-channel scales
    Bias,  # [N] (when HAS_BIAS)
    Out,  # [M, N] in x's dtype
    Part,  # [SPLIT_K, M, N] float32 partial sums (when SPLIT_K > 1)
    Counters,  # int32 arrivals per tile (SUM_HERE)
    M,
    N,
    K,
    K_SLICE,
    stride_xm,
    stride_xs,
    stride_wn,
    BLOCK_M: tl.constexpr,  # 16 or 32: xq^T's padded columns
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SUM_HERE: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_hi
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(XQ + offs_m[None, :] * stride_xm + k[:, None],
                     mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(w, xt, acc)  # fp8 x fp8 -> float32, no widening of W
    # both scales are linear in the sum: each split scales its own part
    acc = acc * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[:, None]
    acc = acc * tl.load(XS + offs_m * stride_xs, mask=m_mask, other=0.0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    _finish(tl.trans(acc), Bias, Out, Part, Counters, offs_m, offs_n, n_mask, mask, pid_k, M, N,
            SPLIT_K, HAS_BIAS, SUM_HERE)  # fmt: skip


def default_launch(n: int, k: int) -> GemvLaunch:
    """The launch used where no timed one is given: 256-wide K steps, K split in two for a long
    reduction (a down projection). On the H100 it ran Llama-3.1-8B's o / gate_up / down
    projections at 1 and 8 rows within 10% of the best of the swept launches, at 49-89% of the
    fp8 copy speed (`python benchmarks/kernel.py fp8 --rows 1 8 --sweep`)."""
    split = 2 if k >= 8192 else 1
    return GemvLaunch(block_n=64, block_k=256, split_k=split, num_warps=4, num_stages=4)


def fp8_gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K] fp8 e4m3, contiguous
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N] in x's dtype
    *,
    input_scale: torch.Tensor | None = None,  # [] float32: static activations, else per token
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, contiguous
    launch: GemvLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """W8A8 as the prefill GEMM computes it (kernels/fp8.fp8_linear_ref): x quantized per token
    (or with `input_scale`) in one launch, then (xq @ weight^T) * x_scale * weight_scale
    (+ bias) summed in float32 and rounded once to x's dtype, for M <= MAX_ROWS rows. `silu_mul`
    and `pdl` as in kernels.skinny.gemv (PDL: the GEMV's launch overlaps the quantization's)."""
    rows, width = x.shape
    n, k = weight.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"fp8_gemv serves 1..{MAX_ROWS} rows, got {rows}")
    if width != (2 * k if silu_mul else k):
        raise ValueError(f"x has {width} columns; weight [{n}, {k}] wants "
                         f"{2 * k if silu_mul else k}{' (gate | up)' if silu_mul else ''}")  # fmt: skip
    if not supports_gemv(weight.device):
        raise ValueError(f"fp8_gemv needs a GPU of compute capability 8.0+, got {weight.device}")
    check_tensor(weight, "weight", (n, k), (FP8,))
    assert weight.is_contiguous(), "fp8_gemv: weight must be contiguous"
    check_tensor(x, "x", (rows, width), FLOATS, weight.device)
    check_tensor(weight_scale, "weight_scale", (n,), (torch.float32,), weight.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), (x.dtype,), weight.device)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    check_tensor(out, "out", (rows, n), (x.dtype,), x.device)
    assert out.is_contiguous(), "fp8_gemv: out must be contiguous"
    xq, x_scale = quantize_activations(x, input_scale, silu_mul=silu_mul)
    launch = launch or default_launch(n, k)
    split = max(1, min(launch.split_k, triton.cdiv(k, launch.block_k)))
    k_slice = triton.cdiv(triton.cdiv(k, split), launch.block_k) * launch.block_k
    split = triton.cdiv(k, k_slice)
    even = n % launch.block_n == 0 and k % k_slice == 0
    grid = (triton.cdiv(n, launch.block_n), split)
    part = (
        out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=out.device)
    )
    counters = arrival_counters(out.device, "fp8_gemv", grid[0]) if split > 1 else None
    pdl = pdl and supports_pdl(weight.device)
    _fp8_gemv_kernel[grid](
        xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, part,
        part if counters is None else counters, rows, n, k, k_slice, xq.stride(0),
        x_scale.stride(0), weight.stride(0), BLOCK_M=16 if rows <= 16 else 32,
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split, EVEN=even,
        HAS_BIAS=bias is not None, SUM_HERE=counters is not None, PDL=pdl, launch_pdl=pdl,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if split > 1 and counters is None:
        block = 1024
        _split_sum_kernel[(triton.cdiv(rows * n, block),)](
            part, bias if bias is not None else weight_scale, out, rows * n, n,
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def fp8_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu_mul: bool = False,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 reference: kernels/fp8.fp8_linear_ref (x quantized as the GEMV quantizes it)."""
    return fp8_linear_ref(x, weight, weight_scale, bias, input_scale, silu_mul)
