"""Skinny projections y = x @ W^T (+ bias) for 1-16 rows of x, built to keep HBM busy."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .arrivals import arrival_counters
from .common import FLOATS, check_tensor, supports_pdl

MAX_ROWS = 16  # rows of x one launch serves (x^T is a dot operand padded to 16 columns)


@dataclass(frozen=True)
class GemvLaunch:
    """One launch's tiling: a program owns block_n rows of W and one of split_k slices of K,
    walked block_k at a time; x^T, padded to 16 columns, makes each step a tl.dot, so Triton
    pipelines W's loads num_stages deep (cp.async). With split_k > 1 the slices' float32 partial
    sums go to a buffer and the last program of a tile to finish adds them up and rounds them
    (kernels/arrivals.py; one more launch does it where no counters are at hand: the same sum,
    bit for bit)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of 2, got {value}")
        if self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"GemvLaunch: block_n and block_k must be >= 16 (dot shapes), "
                             f"got {self.block_n} and {self.block_k}")  # fmt: skip
        if self.num_stages < 1:
            raise ValueError(f"GemvLaunch.num_stages must be >= 1, got {self.num_stages}")


@triton.jit
def _xt_tile(  # type: ignore[no-untyped-def]
    X, offs_m, k, m_mask, k_mask, stride_xm, K, DTYPE: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    """x[offs_m, k]^T ([BLOCK_K, 16], rows past M zero) in DTYPE, a dot operand. With SILU_MUL
    x holds [gate | up] and the value is silu(gate) * up rounded to DTYPE, as silu_and_mul
    stores it."""
    ptrs = X + offs_m[None, :] * stride_xm + k[:, None]
    mask = k_mask[:, None] & m_mask[None, :]
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(DTYPE)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _w_tile(W, offs_n, k, n_mask, k_mask, stride_wn, EVEN: tl.constexpr):  # type: ignore[no-untyped-def]
    ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _finish(  # type: ignore[no-untyped-def]
    acc, Bias, Out, Part, Counters, offs_m, offs_n, n_mask, mask, pid_k, M, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SUM_HERE: tl.constexpr,
):  # fmt: skip
    """Store acc [16, BLOCK_N] (rows past M masked): rounded (+ bias) when one program sums all
    of K; else the float32 partial sums of split pid_k into Part, and with SUM_HERE the tile's
    last program to arrive (kernels/arrivals.py) adds up every split's, in split order as
    _split_sum_kernel does, and stores the rounded sum."""
    if SPLIT_K == 1:
        _store_sum(acc, Bias, Out, offs_m, offs_n, n_mask, mask, N, HAS_BIAS)
    else:
        part_ptrs = Part + (offs_m[:, None] * N + offs_n[None, :])
        tl.store(part_ptrs + pid_k * M * N, acc, mask=mask)
        if SUM_HERE:
            tl.debug_barrier()  # every thread's partial stored before the arrival is counted
            tile = Counters + tl.program_id(0)
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT_K):  # .cg: from the L2, where the others wrote
                    total += tl.load(part_ptrs + s * M * N, mask=mask, other=0.0,
                                     cache_modifier=".cg")  # fmt: skip
                _store_sum(total, Bias, Out, offs_m, offs_n, n_mask, mask, N, HAS_BIAS)
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _store_sum(  # type: ignore[no-untyped-def]
    acc, Bias, Out, offs_m, offs_n, n_mask, mask, N, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K] (or [M, 2K]: gate then up, with SILU_MUL)
    W,  # [N, K]
    Bias,  # [N] (when HAS_BIAS)
    Out,  # [M, N] in W's dtype (unless SPLIT_K > 1 and not SUM_HERE)
    Part,  # [SPLIT_K, M, N] float32 partial sums (when SPLIT_K > 1)
    Counters,  # [>= N / BLOCK_N] int32 arrivals per tile, zeros (SUM_HERE)
    M,
    N,
    K,
    K_SLICE,  # K per split, a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % K_SLICE == 0: W's loads need no mask
    HAS_BIAS: tl.constexpr,
    SUM_HERE: tl.constexpr,  # SPLIT_K > 1: the last split to arrive sums them (else a launch)
    SILU_MUL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 weights (no tf32 rounding)
    PDL: tl.constexpr,  # launched as a programmatic dependent (see gemv)
):
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)  # x^T padded to the smallest dot width
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_k * K_SLICE
    k_hi = tl.minimum(k_lo + K_SLICE, K)
    if PDL:  # let the next kernel launch (it waits for this one), then wait for x
        gdc_launch_dependents()
        gdc_wait()
    dtype = W.dtype.element_ty
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_hi
        w = _w_tile(W, offs_n, k, n_mask, k_mask, stride_wn, EVEN)
        xt = _xt_tile(X, offs_m, k, m_mask, k_mask, stride_xm, K, dtype, SILU_MUL)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    mask = m_mask[:, None] & n_mask[None, :]
    _finish(tl.trans(acc), Bias, Out, Part, Counters, offs_m, offs_n, n_mask, mask, pid_k, M, N,
            SPLIT_K, HAS_BIAS, SUM_HERE)  # fmt: skip


@triton.jit
def _split_sum_kernel(  # type: ignore[no-untyped-def]
    P, Bias, Out, MN, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Out = sum over splits of P [SPLIT_K, M*N] (+ bias), rounded once."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=mask)


@functools.cache  # NOTE: asked at every launch
def supports_gemv(device: torch.device) -> bool:
    """Whether `gemv` compiles for `device`: its tl.dot needs tensor cores of compute capability
    8.0+ on CUDA (elsewhere only the interpreter runs it, for tests)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with silu_mul
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,  # [M, N], contiguous
    launch: GemvLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x @ weight.T (+ bias) summed in float32 and rounded once, for M <= MAX_ROWS rows.

    With `silu_mul`, x holds a gated MLP's [gate | up] and the product is taken with
    silu(gate) * up (each value rounded to weight's dtype first, as `silu_and_mul` stores it):
    the down projection without the activation's own launch.

    With `pdl` (CUDA, compute capability 9.0+; elsewhere ignored) the launches are programmatic
    dependents: each may start while the kernel before it finishes and lets the next one launch
    at once; its programs wait for the kernel before (griddepcontrol.wait) before they touch x
    or write anything. The launch ramps overlap the kernels' tails."""
    rows, width = x.shape
    n, k = weight.shape
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {rows}")
    if width != (2 * k if silu_mul else k):
        raise ValueError(f"x has {width} columns; weight [{n}, {k}] wants "
                         f"{2 * k if silu_mul else k}{' (gate | up)' if silu_mul else ''}")  # fmt: skip
    if not supports_gemv(weight.device):
        raise ValueError(f"gemv needs a GPU of compute capability 8.0+, got {weight.device}")
    check_tensor(weight, "weight", (n, k), FLOATS)
    assert weight.is_contiguous(), "gemv: weight must be contiguous"
    check_tensor(x, "x", (rows, width), (weight.dtype,), weight.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), (weight.dtype,), weight.device)
    if out is None:
        out = torch.empty(rows, n, dtype=weight.dtype, device=weight.device)
    check_tensor(out, "out", (rows, n), (weight.dtype,), weight.device)
    assert out.is_contiguous(), "gemv: out must be contiguous"
    launch = launch or GemvLaunch()
    # each split's K slice a whole number of tiles; fewer splits where K is short
    split = max(1, min(launch.split_k, triton.cdiv(k, launch.block_k)))
    k_slice = triton.cdiv(triton.cdiv(k, split), launch.block_k) * launch.block_k
    split = triton.cdiv(k, k_slice)
    even = n % launch.block_n == 0 and k % k_slice == 0  # k_slice: whole tiles by construction
    grid = (triton.cdiv(n, launch.block_n), split)
    part = (
        out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=out.device)
    )
    counters = arrival_counters(out.device, "gemv", grid[0]) if split > 1 else None
    common = {"BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "SPLIT_K": split,
              "EVEN": even, "HAS_BIAS": bias is not None, "SUM_HERE": counters is not None,
              "SILU_MUL": silu_mul, "num_warps": launch.num_warps,
              "num_stages": launch.num_stages}  # fmt: skip
    args = (x, weight, bias if bias is not None else weight, out, part,
            part if counters is None else counters, rows, n, k, k_slice, x.stride(0),
            weight.stride(0))  # fmt: skip
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    pdl = pdl and supports_pdl(weight.device)
    _gemv_kernel[grid](*args, DOT_PRECISION=precision, PDL=pdl, launch_pdl=pdl, **common)
    if split > 1 and counters is None:
        block = 1024
        _split_sum_kernel[(triton.cdiv(rows * n, block),)](
            part, bias if bias is not None else weight, out, rows * n, n,
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out
