"""The parts of a small decode step in CUDA graphs, each against the copy ceiling: the four
projection GEMMs of Llama-3.1-8B (cuBLAS as torch picks it, cuBLASLt preferred, and a Triton
weight-streaming GEMM swept over its tiles) and the bf16 decode attention at batch 64 over its
split counts and launches.

    python benchmarks/decode_parts.py [--batches 1 64] [--skip-attention]
    python benchmarks/decode_parts.py --splits --blas [--batches ...]   # split counts; cuBLAS paths
    python benchmarks/decode_parts.py --small [--batches 1 8]   # small-batch decode launches
"""

from __future__ import annotations

import argparse
from functools import partial
from itertools import product

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kernel_bench import copy_gbps, decode_bytes, decode_setup, graph_ms

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip


@triton.jit
def _stream_gemm(  # type: ignore[no-untyped-def]
    X,
    W,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=offs_m[:, None] < M)


def stream_gemm(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, bk: int, warps: int, stages: int
) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    _stream_gemm[(n // bn,)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                             num_stages=stages)  # fmt: skip
    return y


def bench_gemms(ceiling: float, batches: list[int]) -> None:
    print("\nprojection GEMMs in a CUDA graph (32 weights, one per layer): us per call, % of copy")
    grid = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256) for w in (4,)
            for st in (4, 6)] + [(16, 256, 2, 6), (16, 512, 4, 4), (32, 512, 4, 3)]  # fmt: skip
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(32)]
        nbytes = n * k * 2
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ys = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]
            ref = F.linear(x, ws[0])
            cells = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = graph_ms([partial(F.linear, x, w) for w in ws])
                cells.append(f"{lib} {ms * 1e3:6.1f} {nbytes / ms / 1e6 / ceiling:4.0%}")
            torch.backends.cuda.preferred_blas_library("cublas")
            results = []
            for bn, bk, warps, st in grid:
                fns = [partial(stream_gemm, x, w, y, bn, bk, warps, st)
                       for w, y in zip(ws, ys, strict=True)]  # fmt: skip
                try:
                    ms = graph_ms(fns)
                except Exception as e:  # noqa: BLE001 - a launch that does not fit is skipped
                    print(f"  {name} M={m} {bn}/{bk}/{warps}/{st}: {type(e).__name__}")
                    continue
                err = (ys[0].float() - ref.float()).abs().max().item()
                results.append((ms, bn, bk, warps, st, err))
            results.sort()
            best = ", ".join(f"{ms * 1e3:.1f} {nbytes / ms / 1e6 / ceiling:.0%} ({bn}/{bk}/{w}/{st}"
                             f" err {e:.3f})" for ms, bn, bk, w, st, e in results[:3])  # fmt: skip
            print(f"  {name:<8} M={m:<3} {' | '.join(cells)} | triton best: {best}")
        del ws
        torch.cuda.empty_cache()


def bench_attention(ceiling: float) -> None:
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bsz, kv = 64, 2048
    sets = [decode_setup(bsz, kv) for _ in range(4)]
    nbytes = decode_bytes(bsz, kv)
    pick = decode_num_kv_splits(bsz, 8, kv, sms)
    print(f"\ndecode attention in a CUDA graph, B={bsz}, kv {kv}, bf16, 4 pools; pick: {pick} "
          "splits; us per call, % of copy")  # fmt: skip
    rows = []
    for splits in (1, 2, 4):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for st in (2, 3):
                    fns = [partial(decode_attention, **a, num_kv_splits=splits, block_n=bn,
                                   num_warps=warps, num_stages=st) for a in sets]  # fmt: skip
                    try:
                        ms = graph_ms(fns)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {splits}/{bn}/{warps}/{st}: {type(e).__name__}")
                        continue
                    rows.append((ms, splits, bn, warps, st))
    default = graph_ms([partial(decode_attention, **a, num_kv_splits=pick) for a in sets])
    print(f"  default: {default * 1e3:.1f} us {nbytes / default / 1e6 / ceiling:.0%}")
    for ms, splits, bn, warps, st in sorted(rows)[:8]:
        print(f"  splits {splits} block_n {bn} warps {warps} stages {st}: {ms * 1e3:.1f} us "
              f"{nbytes / ms / 1e6 / ceiling:.0%}")  # fmt: skip


def bench_splits(ceiling: float, batches: list[int]) -> None:
    """The decode kernel's default launch per split count and batch (bf16, kv 2048, in a graph)."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (1, 2, 4, 8, 16)
    print(f"\ndecode attention in a CUDA graph, kv 2048, bf16: us per call per split count "
          f"({grid}); * = decode_num_kv_splits' pick")  # fmt: skip
    for bsz in batches:
        nbytes = decode_bytes(bsz, 2048)
        layers = max(2, min(32, (256 << 20) // nbytes))
        sets = [decode_setup(bsz, 2048) for _ in range(layers)]
        pick = decode_num_kv_splits(bsz, 8, 2048, sms)
        cells = []
        for splits in grid:
            ms = graph_ms([partial(decode_attention, **a, num_kv_splits=splits) for a in sets])
            mark = "*" if splits == pick else " "
            cells.append(f"{ms * 1e3:6.1f} {nbytes / ms / 1e6 / ceiling:4.0%}{mark}")
        print(f"  B={bsz:<4} " + " | ".join(cells))
        del sets
        torch.cuda.empty_cache()


def bench_small(ceiling: float, batches: list[int], near: bool = False) -> None:
    """The decode kernel at small batches (bf16, kv 2048, in a graph over cold pools) per split
    count and launch (keys per tile, warps, stages), its splits merged by the last to arrive
    (the default) or by the reduce launch: the best eight per batch, and the runtime's launch.
    `near`: only split counts next to the runtime's pick (half, same, double), merged here where
    the merge holds them, and keys per tile 16-64 (a quicker sweep over more batches).

    NOTE: back to back on their own these calls can rank launches unlike a decode step does: at
    batch 8 the runtime's 4-warp launch took 31.9 us here and 23.6 us inside the step's graph
    (profile_step.py runner), where 2 warps (27.0 us here) took 24.1 (BENCHMARKS.md,
    twenty-fourth session). Confirm a launch with one_batch.py --warp-modes or a trace."""
    from weft.kernels.decode import MERGE_MAX_SPLITS, decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\ndecode attention in a CUDA graph, kv 2048, bf16: us per call, % of copy")
    for bsz in batches:
        nbytes = decode_bytes(bsz, 2048)
        sets = [decode_setup(bsz, 2048) for _ in range(max(2, min(32, (256 << 20) // nbytes)))]
        pick = decode_num_kv_splits(bsz, 8, 2048, sms)
        if near:
            grid = [(s, bn, w, st, s <= MERGE_MAX_SPLITS)
                    for s, bn, w, st in product((pick // 2, pick, pick * 2), (16, 32, 64), (2, 4),
                                                (2, 3)) if 2 <= s <= 64]  # fmt: skip
        else:
            grid = list(product((8, 16, 32), (16, 32, 64), (2, 4), (2, 3), (True, False)))
        rows = []
        for splits, bn, warps, st, here in grid:
            fns = [partial(decode_attention, **a, num_kv_splits=splits, block_n=bn,
                           num_warps=warps, num_stages=st, sum_here=here) for a in sets]  # fmt: skip
            rows.append((graph_ms(fns), splits, bn, warps, st, here))
        default = graph_ms([partial(decode_attention, **a, num_kv_splits=pick) for a in sets])
        print(f"  B={bsz}: the runtime's launch ({pick} splits, merged here) "
              f"{default * 1e3:.1f} us {nbytes / default / 1e6 / ceiling:.0%}")  # fmt: skip
        for ms, splits, bn, warps, st, here in sorted(rows)[:8]:
            print(f"    splits {splits:2} block_n {bn:2} warps {warps} stages {st} "
                  f"{'merged here' if here else 'reduce launch'}: {ms * 1e3:.1f} us "
                  f"{nbytes / ms / 1e6 / ceiling:.0%}")  # fmt: skip
        del sets
        torch.cuda.empty_cache()


def bench_blas(ceiling: float, batches: list[int]) -> None:
    """cuBLAS as torch picks it against cuBLASLt preferred, per projection and token count."""
    print(
        "\nprojection GEMMs in a CUDA graph: us per call (cublas | cublaslt), TFLOP/s or % of copy"
    )
    for name, (n, k) in SHAPES.items():
        layers = 8
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(layers)]
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cells = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = graph_ms([partial(F.linear, x, w) for w in ws])
                tflops = 2 * m * n * k / ms / 1e9
                cells.append(
                    f"{ms * 1e3:8.1f} ({tflops:5.0f} TF, {n * k * 2 / ms / 1e6 / ceiling:4.0%})"
                )
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"  {name:<8} M={m:<5} " + " | ".join(cells))
        del ws
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--splits", action="store_true", help="only the split-count sweep")
    ap.add_argument("--blas", action="store_true", help="only cuBLAS against cuBLASLt")
    ap.add_argument("--small", action="store_true", help="only small-batch decode launches")
    ap.add_argument("--near", action="store_true", help="(--small) splits next to the pick only")
    args = ap.parse_args()
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__},"
          f" copy {ceiling:.0f} GB/s")  # fmt: skip
    if args.small:
        bench_small(ceiling, args.batches, args.near)
        return
    if args.splits or args.blas:
        if args.splits:
            bench_splits(ceiling, args.batches)
        if args.blas:
            bench_blas(ceiling, [1, 8, 32, 64, 128, 256, 512, 1024, 4096, 8192])
        return
    if not args.skip_attention:
        bench_attention(ceiling)
    bench_gemms(ceiling, args.batches)


if __name__ == "__main__":
    main()
