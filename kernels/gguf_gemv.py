"""GGUF blocks in Triton: x @ W^T with W dequantized in registers (decode: weights read once) and
W dequantized tile by tile to a dense matrix (prefill: then one cuBLAS GEMM)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import FLOATS, check_tensor
from .gguf import block_type

MAX_ROWS = 64  # rows of x the fused kernel serves (more: dequantize, then a dense GEMM)


@dataclass(frozen=True)
class GGUFLaunch:
    """A program owns block_n rows of W and one of split_k slices of its blocks, and all rows of
    x up to block_m at a time; each step dequantizes one tile of W (one super-block of 256 for
    the K-quants, `legacy_blocks` blocks of 32 for the others) into registers and takes its
    tl.dot with x^T. split_k > 1: float32 partial sums summed by torch (deterministic).

    block_n 64: on the H100 at Qwen2.5-Coder-1.5B's Q4_K_M shapes, one row of x, the layer's
    projections and the LM head took 7% less time than at 32 (Q4_K gate_up 30.9 against
    36.0 us, Q6_K LM head 254.9 against 266.6 us; only Q6_K gate_up, which that file lacks, was
    slower: 52.7 against 42.9 us; `python benchmarks/kernel.py gguf --rows 1 --sweep`)."""

    block_n: int = 64
    split_k: int = 0  # 0: enough splits to give every SM two programs
    num_warps: int = 4
    legacy_blocks: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "legacy_blocks"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GGUFLaunch.{name} must be a power of 2, got {value}")
        if self.block_n < 16:
            raise ValueError(f"GGUFLaunch.block_n must be >= 16 (dot shapes), got {self.block_n}")
        if self.split_k < 0:
            raise ValueError(f"GGUFLaunch.split_k must be >= 0, got {self.split_k}")


##### Dequantizing a tile in registers #####


@triton.jit
def _f16(ptr):  # type: ignore[no-untyped-def]
    """The little-endian float16 at byte pointers `ptr` (any alignment), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr):  # type: ignore[no-untyped-def]
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _tile(  # type: ignore[no-untyped-def]
    W, rows, step, row_bytes, QTYPE: tl.constexpr, NBYTES: tl.constexpr, SUB: tl.constexpr,
    SUBLEN: tl.constexpr,
):  # fmt: skip
    """W's tile `step` (SUB * SUBLEN weights along K) of rows `rows` [BN, 1, 1] (all valid),
    dequantized: float32 [BN, SUB, SUBLEN]. K-quants: one super-block per step, SUB of its
    sub-blocks; the others: SUB blocks of 32."""
    s = tl.arange(0, SUB)[None, :, None]
    j = tl.arange(0, SUBLEN)[None, None, :]
    row = W + rows.to(tl.int64) * row_bytes
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales/mins
        base = row + step * NBYTES
        lo = s < 4
        a = _byte(base + 4 + s)  # scales[s]
        b = _byte(base + 8 + s)  # scales[s + 4]
        c = _byte(base + 4 + tl.where(lo, s, s - 4))  # scales[s - 4] (s >= 4)
        sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
        qs = base + (16 if QTYPE == 12 else 48)
        byte = _byte(qs + (s // 2) * 32 + j)
        q = tl.where(s % 2 == 0, byte & 15, byte >> 4)
        if QTYPE == 13:
            q = q | (((_byte(base + 16 + j) >> s) & 1) << 4)
        d = _f16(base) * sc.to(tl.float32)
        dm = _f16(base + 2) * mn.to(tl.float32)
        return d * q.to(tl.float32) - dm
    elif QTYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d; SUB = 16 groups of 16
        base = row + step * NBYTES
        e = s * 16 + j  # element of the super-block
        half = e // 128
        r = e % 128
        low = _byte(base + half * 64 + r % 64)
        low = tl.where(r < 64, low & 15, low >> 4)
        high = (_byte(base + 128 + half * 32 + r % 32) >> ((r // 32) * 2)) & 3
        q = (low | (high << 4)) - 32
        sc = tl.load(base + 192 + s).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(base + 208) * sc) * q.to(tl.float32)
    # 32-weight blocks: block index step * SUB + s
    base = row + (step * SUB + s) * NBYTES
    d = _f16(base)
    if QTYPE == 8:  # Q8_0: d, 32 int8 quants
        return tl.load(base + 2 + j).to(tl.int8, bitcast=True).to(tl.float32) * d
    if QTYPE == 2:  # Q4_0: d, 16 bytes of nibbles (low ones first)
        q = _nibble(base + 2, j)
        return d * (q - 8).to(tl.float32)
    if QTYPE == 3:  # Q4_1: d, m, nibbles
        q = _nibble(base + 4, j)
        return d * q.to(tl.float32) + _f16(base + 2)
    if QTYPE == 6:  # Q5_0: d, the fifth bits (a little-endian uint32), nibbles
        q = _nibble(base + 6, j) | (((_byte(base + 2 + j // 8) >> (j % 8)) & 1) << 4)
        return d * (q - 16).to(tl.float32)
    # Q5_1: d, m, fifth bits, nibbles
    q = _nibble(base + 8, j) | (((_byte(base + 4 + j // 8) >> (j % 8)) & 1) << 4)
    return d * q.to(tl.float32) + _f16(base + 2)


@triton.jit
def _nibble(qs, j):  # type: ignore[no-untyped-def]
    """Quant j (0..31) of a 32-weight block whose 16 bytes of nibbles start at qs."""
    byte = _byte(qs + j % 16)
    return tl.where(j < 16, byte & 15, byte >> 4)


##### The kernels #####


@triton.jit
def _matmul_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K]
    W,  # [N, row_bytes] uint8 blocks
    Bias,  # [N] (HAS_BIAS)
    Out,  # [M, N] (stride_om) in X's dtype; [SPLIT_K, M, N] float32 when SPLIT_K > 1
    M, N, K, row_bytes, steps_per_split, stride_xm, stride_om,
    QTYPE: tl.constexpr, NBYTES: tl.constexpr, SUB: tl.constexpr, SUBLEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    BLOCK_K: tl.constexpr = SUB * SUBLEN
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(2)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = tl.minimum(offs_n, N - 1)[:, None, None]  # rows past N repeat the last (not stored)
    offs_k = tl.arange(0, BLOCK_K)
    steps = K // BLOCK_K
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(first, last):
        w = tl.reshape(
            _tile(W, rows, step, row_bytes, QTYPE, NBYTES, SUB, SUBLEN), [BLOCK_N, BLOCK_K]
        )
        k = step * BLOCK_K + offs_k
        xt = tl.load(X + offs_m[None, :] * stride_xm + k[:, None], mask=m_mask[None, :], other=0.0)
        acc = tl.dot(w.to(X.dtype.element_ty), xt, acc, input_precision=DOT_PRECISION)
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, out.to(Out.dtype.element_ty), mask=mask)
    else:
        ptrs = Out + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, out, mask=mask)


@triton.jit
def _dequant_kernel(  # type: ignore[no-untyped-def]
    W, Out, N, row_bytes, stride_on,
    QTYPE: tl.constexpr, NBYTES: tl.constexpr, SUB: tl.constexpr, SUBLEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    BLOCK_K: tl.constexpr = SUB * SUBLEN
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    step = tl.program_id(1)
    rows = tl.minimum(offs_n, N - 1)[:, None, None]
    w = tl.reshape(_tile(W, rows, step, row_bytes, QTYPE, NBYTES, SUB, SUBLEN), [BLOCK_N, BLOCK_K])
    k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = Out + offs_n.to(tl.int64)[:, None] * stride_on + k[None, :]
    tl.store(ptrs, w.to(Out.dtype.element_ty), mask=(offs_n < N)[:, None])


##### Launch wrappers #####


def _tiling(ggml_id: int, launch: GGUFLaunch) -> tuple[int, int]:
    """(SUB, SUBLEN) of one step's tile."""
    if ggml_id in (12, 13):
        return 8, 32
    if ggml_id == 14:
        return 16, 16
    return launch.legacy_blocks, 32


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def matmul(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    blocks: torch.Tensor,  # [N, row_bytes] uint8
    ggml_id: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    out: torch.Tensor | None = None,  # [M, N], unit stride in N (a column slice of a wider one)
    launch: GGUFLaunch | None = None,
) -> torch.Tensor:
    """x @ W^T (+ bias) with W's blocks dequantized in registers, summed in float32: the decode
    path (each weight byte read once per launch for up to MAX_ROWS rows)."""
    rows, k = x.shape
    n = blocks.shape[0]
    t = block_type(ggml_id)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gguf matmul serves 1..{MAX_ROWS} rows, got {rows}")
    check_tensor(blocks, "blocks", (n, t.row_bytes(k)), (torch.uint8,))
    assert blocks.is_contiguous(), "gguf matmul: blocks must be contiguous"
    check_tensor(x, "x", (rows, k), FLOATS, blocks.device)
    if bias is not None:
        check_tensor(bias, "bias", (n,), None, blocks.device)
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    check_tensor(out, "out", (rows, n), (x.dtype,), x.device)
    launch = launch or GGUFLaunch()
    sub, sublen = _tiling(ggml_id, launch)
    if k % (sub * sublen):
        sub, sublen = 1, t.block  # K-quants always divide; legacy rows of odd block counts
    steps = k // (sub * sublen)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    tiles = triton.cdiv(n, launch.block_n) * triton.cdiv(rows, block_m)
    split = launch.split_k or max(1, min(steps, 2 * _sm_count(x.device) // max(tiles, 1)))
    per_split = triton.cdiv(steps, max(1, min(split, steps)))
    split = triton.cdiv(steps, per_split)
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(rows, block_m), split)
    target = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32,
                                                device=x.device)  # fmt: skip
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _matmul_kernel[grid](
        x, blocks, bias if bias is not None else blocks, target, rows, n, k, blocks.shape[1],
        per_split, x.stride(0), out.stride(0), QTYPE=ggml_id, NBYTES=t.nbytes, SUB=sub, SUBLEN=sublen,
        BLOCK_N=launch.block_n, BLOCK_M=block_m, SPLIT_K=split, HAS_BIAS=bias is not None,
        DOT_PRECISION=precision, num_warps=launch.num_warps,
    )  # fmt: skip
    if split > 1:
        total = target.sum(0)
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out


def dequantize(blocks: torch.Tensor, ggml_id: int, k: int, dtype: torch.dtype,
               out: torch.Tensor | None = None, block_n: int = 32) -> torch.Tensor:  # fmt: skip
    """W [N, K] in `dtype` from its blocks [N, row_bytes] (prefill: then a dense GEMM)."""
    n = blocks.shape[0]
    t = block_type(ggml_id)
    check_tensor(blocks, "blocks", (n, t.row_bytes(k)), (torch.uint8,))
    assert blocks.is_contiguous(), "gguf dequantize: blocks must be contiguous"
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    check_tensor(out, "out", (n, k), (dtype,), blocks.device)
    sub, sublen = _tiling(ggml_id, GGUFLaunch())
    if k % (sub * sublen):
        sub, sublen = 1, t.block
    grid = (triton.cdiv(n, block_n), k // (sub * sublen))
    _dequant_kernel[grid](blocks, out, n, blocks.shape[1], out.stride(0), QTYPE=ggml_id,
                          NBYTES=t.nbytes, SUB=sub, SUBLEN=sublen, BLOCK_N=block_n)  # fmt: skip
    return out
