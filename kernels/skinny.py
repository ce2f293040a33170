"""Skinny projections y = x @ W^T (+ bias) for 1-16 rows of x, built to keep HBM busy."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .arrivals import arrival_counters
from .common import check_tensor, supports_pdl
from .timeline import now, stamps, trace_for

MAX_ROWS = 16  # rows of x one launch serves (x^T is a dot operand padded to 16 columns)


@dataclass(frozen=True)
class GemvLaunch:
    """One launch's tiling: a program owns block_n rows of W and one of split_k slices of K,
    walked block_k at a time; x^T, padded to 16 columns, makes each step a tl.dot, so Triton
    pipelines W's loads num_stages deep (cp.async). With split_k > 1 the slices' float32 partial
    sums go to a buffer; with sum_here the last program of a tile to finish adds them up (and
    rounds them), else one more launch does (the same sum, bit for bit). (A dot-free kind with
    the next tile's load issued by hand reached 37-83% of copy speed against this one's 66-98%:
    BENCHMARKS.md, twentieth session.)"""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    sum_here: bool = True

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


class AddNorm(NamedTuple):
    """`fused_add_rmsnorm`'s add as the GEMV's epilogue: with y the rounded product, residual <-
    round(y + residual) in place (the product itself is not stored), and squares[m, tile] <- the
    sum of the new row m squared over the tile's columns. The next GEMV takes the residual as x
    with NormedX, which normalises it: the RMSNorm's own launch folded away."""

    residual: torch.Tensor  # [M, N] contiguous, the residual stream
    squares: torch.Tensor  # [M, norm_tiles(N, launch)] float32, written


class NormedX(NamedTuple):
    """x is an AddNorm's residual, normalised tile by tile as it is loaded: round(round(x *
    rsqrt(sum(squares[m]) / K + eps)) * weight), what `rmsnorm` stores, so the product is the
    unfolded chain's (up to the float32 order of the squares' sum)."""

    weight: torch.Tensor  # [K] the RMSNorm's weight
    squares: torch.Tensor  # [M, T] float32, an AddNorm's
    eps: float


def norm_tiles(n: int, launch: GemvLaunch) -> int:
    """The columns of AddNorm.squares for an [n, K] weight under `launch`."""
    return triton.cdiv(n, launch.block_n)


@triton.jit
def _xt_tile(  # type: ignore[no-untyped-def]
    X, offs_m, k, m_mask, k_mask, stride_xm, K, Gamma, rstd, DTYPE: tl.constexpr,
    SILU_MUL: tl.constexpr, NORM_X: tl.constexpr,
):  # fmt: skip
    """x[offs_m, k]^T ([BLOCK_K, 16], rows past M zero) in DTYPE, a dot operand. With SILU_MUL
    x holds [gate | up] and the value is silu(gate) * up rounded to DTYPE, as silu_and_mul
    stores it; with NORM_X, x's row m times rstd[m], rounded, times Gamma[k], rounded, as the
    RMSNorm kernel stores it."""
    ptrs = X + offs_m[None, :] * stride_xm + k[:, None]
    mask = k_mask[:, None] & m_mask[None, :]
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(DTYPE)
    if NORM_X:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(Gamma + k, mask=k_mask, other=0.0).to(tl.float32)
        return ((x * rstd[None, :]).to(DTYPE).to(tl.float32) * g[:, None]).to(DTYPE)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _w_tile(W, offs_n, k, n_mask, k_mask, stride_wn, EVEN: tl.constexpr):  # type: ignore[no-untyped-def]
    ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _finish(  # type: ignore[no-untyped-def]
    acc, Bias, Out, Part, Counters, offs_m, offs_n, m_mask, n_mask, pid_k, M, N, r, Squares,
    n_tiles, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SUM_HERE: tl.constexpr,
    ADD_NORM: tl.constexpr,
):  # fmt: skip
    """Store acc [16, BLOCK_N] (rows past M masked): rounded (+ bias) when one program sums all
    of K; else the float32 partial sums of split pid_k into Part, and with SUM_HERE the tile's
    last program to arrive (kernels/arrivals.py) adds up every split's, in split order as
    _split_sum_kernel does, and stores the rounded sum (with ADD_NORM: AddNorm's epilogue over r,
    the tile's residual, loaded before the walk)."""
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        _store_sum(acc, Bias, Out, offs_m, offs_n, m_mask, n_mask, mask, N, HAS_BIAS, r, Squares,
                   n_tiles, ADD_NORM)  # fmt: skip
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
                _store_sum(total, Bias, Out, offs_m, offs_n, m_mask, n_mask, mask, N, HAS_BIAS,
                           r, Squares, n_tiles, ADD_NORM)  # fmt: skip
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _store_sum(  # type: ignore[no-untyped-def]
    acc, Bias, Out, offs_m, offs_n, m_mask, n_mask, mask, N, HAS_BIAS: tl.constexpr, r, Squares,
    n_tiles, ADD_NORM: tl.constexpr,
):  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Out.dtype.element_ty)
    if ADD_NORM:  # Out is the residual r: round(y + r), as fused_add_rmsnorm rounds the sum
        y = (y.to(tl.float32) + r).to(Out.dtype.element_ty)
        hf = y.to(tl.float32)
        tl.store(Squares + offs_m * n_tiles + tl.program_id(0), tl.sum(hf * hf, 1), mask=m_mask)
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K] (or [M, 2K]: gate then up, with SILU_MUL)
    W,  # [N, K]
    Bias,  # [N] (when HAS_BIAS)
    Out,  # [M, N] in W's dtype (unless SPLIT_K > 1 and not SUM_HERE)
    Part,  # [SPLIT_K, M, N] float32 partial sums (when SPLIT_K > 1)
    Counters,  # [>= N / BLOCK_N] int32 arrivals per tile, zeros (SUM_HERE)
    Trace,  # int64 (when TRACE) per program: start, wait returned, K walked, end (ns), SM
    Gamma,  # [K] (NORM_X) the RMSNorm's weight
    Squares,  # [M, n_tiles] float32: written (ADD_NORM) or read (NORM_X)
    M,
    N,
    K,
    n_tiles,
    eps,
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
    ADD_NORM: tl.constexpr,  # AddNorm: Out (the residual) += the product; Squares[:, pid 0]
    NORM_X: tl.constexpr,  # NormedX: x's rows normalised by rsqrt(sum(Squares[m]) / K + eps)
    BLOCK_T: tl.constexpr,  # (NORM_X) >= n_tiles
    PDL: tl.constexpr,  # launched as a programmatic dependent (see gemv)
    TRACE: tl.constexpr,  # write the program's stamps (kernels/timeline.py)
):
    t0 = now() if TRACE else 0
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
    t1 = now() if TRACE else 0
    dtype = W.dtype.element_ty
    # what the epilogue reads besides the product, loaded before the walk hides their latency
    r = tl.zeros([16, BLOCK_N], tl.float32)
    if ADD_NORM:
        r_ptrs = Out + offs_m[:, None] * N + offs_n[None, :]
        r = tl.load(r_ptrs, mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    rstd = tl.zeros([16], tl.float32)
    if NORM_X:
        offs_t = tl.arange(0, BLOCK_T)
        sq_mask = m_mask[:, None] & (offs_t < n_tiles)[None, :]
        sq = tl.load(Squares + offs_m[:, None] * n_tiles + offs_t[None, :], mask=sq_mask, other=0.0)
        rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_hi
        w = _w_tile(W, offs_n, k, n_mask, k_mask, stride_wn, EVEN)
        xt = _xt_tile(X, offs_m, k, m_mask, k_mask, stride_xm, K, Gamma, rstd, dtype, SILU_MUL,
                      NORM_X)  # fmt: skip
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    t2 = now() if TRACE else 0
    _finish(tl.trans(acc), Bias, Out, Part, Counters, offs_m, offs_n, m_mask, n_mask, pid_k, M,
            N, r, Squares, n_tiles, SPLIT_K, HAS_BIAS, SUM_HERE, ADD_NORM)  # fmt: skip
    if TRACE:
        program = tl.program_id(0) * SPLIT_K + pid_k
        t3 = now()
        stamps(Trace, program, t0, t1, t2, t3)


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
    add_norm: AddNorm | None = None,
    normed_x: NormedX | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) summed in float32 and rounded once, for M <= MAX_ROWS rows.

    With `add_norm` the product is added to the residual stream in place, which is returned
    (no `out`), and the squares its RMSNorm needs are written (AddNorm); with `normed_x`, x is
    such a residual and the RMSNorm is applied as x is loaded (NormedX). A pair of them is
    `fused_add_rmsnorm` between two projections without the norm's own launch, the same values.

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
    floats = (torch.float16, torch.bfloat16, torch.float32)
    check_tensor(weight, "weight", (n, k), floats)
    assert weight.is_contiguous(), "gemv: weight must be contiguous"
    check_tensor(x, "x", (rows, width), (weight.dtype,), weight.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), (weight.dtype,), weight.device)
    if add_norm is not None:
        if out is not None:
            raise ValueError("gemv: with add_norm the product goes into add_norm.residual; no out")
        out = add_norm.residual
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
    counters = (
        arrival_counters(out.device, "gemv", grid[0]) if split > 1 and launch.sum_here else None
    )
    if add_norm is not None and split > 1 and counters is None:
        raise ValueError("gemv: add_norm needs the K splits summed in the GEMV (sum_here, "
                         "with arrival counters made before any capture)")  # fmt: skip
    gamma, squares, n_tiles, eps, flags = _norm_args(x, weight, grid[0], silu_mul, add_norm,
                                                     normed_x)  # fmt: skip
    common = {"BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "SPLIT_K": split,
              "EVEN": even, "HAS_BIAS": bias is not None, "SUM_HERE": counters is not None,
              "SILU_MUL": silu_mul, "num_warps": launch.num_warps,
              "num_stages": launch.num_stages}  # fmt: skip
    trace, traced = trace_for(f"gemv {n}x{k}", grid[0] * grid[1], out)
    args = (x, weight, bias if bias is not None else weight, out, part,
            part if counters is None else counters, trace, gamma, squares, rows, n, k, n_tiles,
            eps, k_slice, x.stride(0), weight.stride(0))  # fmt: skip
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"
    pdl = pdl and supports_pdl(weight.device)
    _gemv_kernel[grid](*args, DOT_PRECISION=precision, PDL=pdl, launch_pdl=pdl, TRACE=traced,
                       **common, **flags)  # fmt: skip
    if split > 1 and counters is None:
        block = 1024
        _split_sum_kernel[(triton.cdiv(rows * n, block),)](
            part, bias if bias is not None else weight, out, rows * n, n,
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def _norm_args(
    x: torch.Tensor, weight: torch.Tensor, tiles: int, silu_mul: bool, add_norm: AddNorm | None,
    normed_x: NormedX | None,
) -> tuple[torch.Tensor, torch.Tensor, int, float, dict[str, object]]:  # fmt: skip
    """The kernel's (Gamma, Squares, n_tiles, eps, flags) for gemv's AddNorm or NormedX over a
    grid of `tiles` column tiles (ValueError where they do not fit); placeholders without."""
    rows, k = x.shape[0], weight.shape[1]
    flags: dict[str, object] = {"ADD_NORM": add_norm is not None,
                                "NORM_X": normed_x is not None, "BLOCK_T": 1}  # fmt: skip
    if add_norm is not None and normed_x is not None:
        raise ValueError("gemv: add_norm and normed_x share the squares argument; pass one")
    if add_norm is not None:
        squares = add_norm.squares
        check_tensor(squares, "add_norm.squares", (rows, tiles), (torch.float32,), x.device)
        assert squares.is_contiguous(), "gemv: add_norm.squares must be contiguous"
        return weight, squares, tiles, 0.0, flags
    if normed_x is not None:
        gamma, squares, eps = normed_x
        if silu_mul:
            raise ValueError("gemv: normed_x takes a residual stream as x, not [gate | up]")
        if not eps >= 0:
            raise ValueError(f"gemv: normed_x.eps must be >= 0, got {eps}")
        check_tensor(gamma, "normed_x.weight", (k,), None, x.device)
        check_tensor(squares, "normed_x.squares", (rows, None), (torch.float32,), x.device)
        assert squares.is_contiguous(), "gemv: normed_x.squares must be contiguous"
        flags["BLOCK_T"] = triton.next_power_of_2(squares.shape[1])
        return gamma, squares, squares.shape[1], float(eps), flags
    return weight, x, 1, 0.0, flags
