"""The FP8 skinny GEMV: y = (x @ W^T) * w_scale (+ bias) for 1-32 rows of x, W read once at fp8 and
widened to x's dtype in registers (per-output-channel scales applied to the float32 sums)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .arrivals import arrival_counters
from .common import check_tensor, supports_pdl
from .skinny import GemvLaunch, _finish, _split_sum_kernel, _xt_tile, supports_gemv

MAX_ROWS = 32  # x^T is a dot operand padded to 16 columns (1-16 rows) or 32 (17-32 rows)
FP8 = torch.float8_e4m3fn


@triton.jit
def _fp8_gemv_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K] (or [M, 2K]: gate then up, with SILU_MUL)
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
    stride_wn,
    BLOCK_M: tl.constexpr,  # 16 or 32: x^T's padded columns
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SUM_HERE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
    dtype = X.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_hi
        if EVEN:
            w8 = tl.load(w_rows + k[None, :])
        else:
            w8 = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w8.to(dtype)  # every e4m3 value is exact in float16, bfloat16 and float32
        xt = _xt_tile(X, offs_m, k, m_mask, k_mask, stride_xm, K, dtype, SILU_MUL)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    # the channel scale is linear in the sum: each split scales its own part
    acc = acc * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[:, None]
    mask = m_mask[:, None] & n_mask[None, :]
    _finish(tl.trans(acc), Bias, Out, Part, Counters, offs_m, offs_n, n_mask, mask, pid_k, M, N,
            SPLIT_K, HAS_BIAS, SUM_HERE)  # fmt: skip


def default_launch(n: int, k: int) -> GemvLaunch:
    """The launch used where no timed one is given: 128-wide K steps (fp8 tiles are half the
    bytes of bf16's), K split so that a long reduction (a down projection) still fills the GPU
    with programs."""
    split = 4 if k >= 8192 else 2 if k >= 4096 and n <= 4096 else 1
    return GemvLaunch(block_n=64, block_k=128, split_k=split, num_warps=4, num_stages=4)


def fp8_gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K] fp8 e4m3, contiguous
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N] in x's dtype
    *,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, contiguous
    launch: GemvLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """(x @ weight^T) * weight_scale (+ bias), summed in float32 and rounded once to x's dtype,
    for M <= MAX_ROWS rows. The activations stay in x's dtype (W8A16: decode keeps more of x's
    precision than the W8A8 GEMM, at the same weight bytes). `silu_mul` and `pdl` as in
    kernels.skinny.gemv."""
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
    floats = (torch.float16, torch.bfloat16, torch.float32)
    check_tensor(x, "x", (rows, width), floats, weight.device)
    check_tensor(weight_scale, "weight_scale", (n,), (torch.float32,), weight.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), (x.dtype,), weight.device)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    check_tensor(out, "out", (rows, n), (x.dtype,), x.device)
    assert out.is_contiguous(), "fp8_gemv: out must be contiguous"
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
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, part,
        part if counters is None else counters, rows, n, k, k_slice, x.stride(0), weight.stride(0),
        BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        SPLIT_K=split, EVEN=even, HAS_BIAS=bias is not None, SUM_HERE=counters is not None,
        SILU_MUL=silu_mul, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl, launch_pdl=pdl, num_warps=launch.num_warps, num_stages=launch.num_stages,
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
) -> torch.Tensor:
    """float32 reference: x (silu(gate) * up rounded to x's dtype with silu_mul) times the
    dequantized weight."""
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    y = x.float() @ (weight.float() * weight_scale.float()[:, None]).T
    return y if bias is None else y + bias.float()
