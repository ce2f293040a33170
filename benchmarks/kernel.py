"""Kernel benchmarks on CUDA: each weft kernel against the device-to-device copy ceiling measured in
the same run (or its peer: FlashInfer, cuBLAS, torch).

    python benchmarks/kernel.py copy                     # the ceiling itself
    python benchmarks/kernel.py summary                  # decode B=64, RMSNorm, argmax (~1 min)
    python benchmarks/kernel.py decode [--fp8] [--splits | --launches] [--batches 1 8 64 256]
    python benchmarks/kernel.py shared [--fp8] [--groups 4 16] [--own 256] [--launches | --pools]
    python benchmarks/kernel.py extend [--launches | --work]
    python benchmarks/kernel.py gemv [--rows 1 8 16] [--shapes qkv down] [--layers-only]
    python benchmarks/kernel.py fp8 [--rows 1 8 32 64] [--sweep]   # FP8 GEMV vs W8A8 vs bf16
    python benchmarks/kernel.py blas [--tokens 1 8 64 512]
    python benchmarks/kernel.py gguf [--types Q4_K Q6_K] [--rows 1 32] [--sweep]  # GGUF blocks
    python benchmarks/kernel.py elementwise              # norms, SiLU, rotary, KV store, bitmask, argmax
    python benchmarks/kernel.py allreduce [--world 2]    # NCCL vs one-shot, several GPUs

Times are medians of CUDA-event timings after warm-up: eager calls with the L2 flushed between
them (triton.testing.do_bench), or calls back to back inside one CUDA graph over cold data where a
decode step's graph is what matters (no launch or host cost). GB/s counts the fewest bytes each
kernel must move (every input read once, every output written once), read plus written, as the
copy ceiling does. Data is random; shapes are Llama-3.1-8B's (32 q / 8 kv heads, d=128, hidden
4096, intermediate 14336, vocabulary 128,256), pages of 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime
from pathlib import Path

import torch
from bench_utils import device_name, git_commit, local_copy_bandwidth


def summary(ceiling: float) -> None:
    """The figures the CUDA kernel tests used to print: decode attention at B=64 (kv 2048) and
    RMSNorm at 4096 x 4096 against the copy ceiling, argmax_rows against torch.argmax."""
    from kernel_decode import bench_decode
    from kernel_elementwise import bench_argmax, rmsnorm_case
    from kernel_util import share, time_ms

    bench_decode(ceiling, False, [64], 2048)
    norm, eager, nbytes = rmsnorm_case()
    print(f"\nrmsnorm T=4096 hidden 4096: {share(nbytes, time_ms(norm), ceiling)} | torch eager "
          f"{share(nbytes, time_ms(eager), ceiling)}")  # fmt: skip
    bench_argmax()


def run(args: argparse.Namespace, ceiling: float) -> None:
    what = args.what
    if what == "summary":
        summary(ceiling)
    elif what == "decode":
        import kernel_decode as kd
        import kernel_util

        kernel_util.KV_HEADS = args.kv_heads  # (read by decode_setup / decode_bytes / splits)
        bench = (
            kd.bench_splits
            if args.splits
            else kd.bench_launches
            if args.launches
            else kd.bench_decode
        )
        batches = args.batches or ([64, 256, 512] if args.fp8 else [1, 8, 64, 256])
        bench(ceiling, args.fp8, batches, args.kv_len or (1536 if args.fp8 else 2048))
    elif what == "shared":
        import kernel_shared as ks

        if args.pools:
            ks.bench_prefix_pools(ceiling)
        else:
            groups = args.groups or ([64] if args.fp8 else [4, 16])
            ks.bench_shared(ceiling, args.fp8, groups, args.own, args.launches)
    elif what == "extend":
        import kernel_extend as ke

        ke.bench_extend_work() if args.work else ke.bench_extend(args.launches)
    elif what == "gemv":
        import kernel_gemm as kg

        kg.bench_layers(args.layers, ceiling, args.reps)
        for name, n, k, silu in [] if args.layers_only else kg.SHAPES:
            if not args.shapes or name in args.shapes:
                kg.bench_shape(name, n, k, silu, args.rows, args.layers, kg.LAUNCHES, ceiling,
                               args.reps)  # fmt: skip
    elif what == "gguf":
        from kernel_gemm import bench_gguf

        bench_gguf(ceiling, args.types, args.rows, args.layers, args.reps, args.sweep)
    elif what == "fp8":
        from kernel_fp8 import bench_fp8

        bench_fp8(ceiling, args.rows, args.layers, args.reps, args.sweep)
    elif what == "blas":
        from kernel_gemm import bench_blas

        bench_blas(ceiling, args.tokens)
    elif what == "elementwise":
        from kernel_elementwise import bench_elementwise

        bench_elementwise(ceiling)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output-file", type=Path, help="JSON: the copy ceiling, device, command")
    sub = ap.add_subparsers(dest="what", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=text)

    add("copy", "device-to-device copy bandwidth")
    add("summary", "decode B=64 and RMSNorm vs copy, argmax vs torch")
    dec = add("decode", "paged decode attention (bf16 or fp8 pool)")
    dec.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) pool (default kv 1536)")
    dec.add_argument("--batches", type=int, nargs="+")
    dec.add_argument("--kv-len", type=int, help="tokens per request (2048; fp8: 1536)")
    dec.add_argument("--kv-heads", type=int, default=8,
                     help="kv heads of 32 q heads (8: Llama-3.1-8B; 4: Qwen3-30B-A3B)")  # fmt: skip
    mode = dec.add_mutually_exclusive_group()
    mode.add_argument("--splits", action="store_true", help="per split count, in a graph")
    mode.add_argument("--launches", action="store_true", help="tiles, warps, stages swept")
    sh = add("shared", "decode over shared prefixes (the prefix-sharing run)")
    sh.add_argument("--fp8", action="store_true", help="an fp8 pool, 64 groups (the run's batch)")
    sh.add_argument("--groups", type=int, nargs="+", help="groups of 16 (4 16; fp8: 64)")
    sh.add_argument("--own", type=int, default=256, help="each request's own keys")
    mode = sh.add_mutually_exclusive_group()
    mode.add_argument("--launches", action="store_true", help="both kernels' launches swept")
    mode.add_argument("--pools", action="store_true", help="the prefix kernel alone, bf16 vs fp8")
    ext = add("extend", "extend attention over a paged prefix")
    mode = ext.add_mutually_exclusive_group()
    mode.add_argument("--launches", action="store_true", help="tiles and warps swept")
    mode.add_argument("--work", action="store_true", help="grid vs work list of query blocks")
    gemv = add("gemv", "skinny GEMV vs cuBLAS at 1-16 rows, in graphs")
    gemv.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    gemv.add_argument("--layers", type=int, default=12, help="distinct weights per graph")
    gemv.add_argument("--reps", type=int, default=20)
    gemv.add_argument("--layers-only", action="store_true", help="only the one-row layer chain")
    gemv.add_argument(
        "--shapes", nargs="+", choices=["qkv", "o_proj", "gate_up", "down", "lm_head"]
    )
    gg = add("gguf", "GGUF blocks' dequantizing matmul vs copy and cuBLAS bf16, in graphs")
    gg.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"],
                    choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])  # fmt: skip
    gg.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    gg.add_argument("--layers", type=int, default=12, help="distinct weights per graph")
    gg.add_argument("--reps", type=int, default=20)
    gg.add_argument("--sweep", action="store_true", help="every launch of GGUF_LAUNCHES")
    f8 = add("fp8", "FP8 GEMV vs W8A8 _scaled_mm vs bf16 cuBLAS at the 8B shapes, in graphs")
    f8.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 1024])
    f8.add_argument("--layers", type=int, default=12, help="distinct weights per graph")
    f8.add_argument("--reps", type=int, default=20)
    f8.add_argument("--sweep", action="store_true", help="GEMV launches swept (rows <= 32)")
    blas = add("blas", "cuBLAS vs cuBLASLt per projection and token count")
    blas.add_argument("--tokens", type=int, nargs="+",
                      default=[1, 8, 32, 64, 128, 256, 512, 1024, 4096, 8192])  # fmt: skip
    add("elementwise", "norms, SiLU, rotary, KV store, bitmask; argmax")
    ar = add("allreduce", "NCCL vs one-shot all-reduce over several GPUs")
    ar.add_argument("--world", type=int, default=2)
    ar.add_argument("--dtype", default="bfloat16")
    ar.add_argument("--numels", type=int, nargs="+")
    ar.add_argument("--ops", type=int, default=100, help="all-reduces per captured graph")
    ar.add_argument("--reps", type=int, default=20)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and args.what != "copy":
        print("benchmarks/kernel.py needs CUDA (but for `copy`)", file=sys.stderr)
        return 2
    if args.what == "allreduce":
        from kernel_allreduce import DEFAULT_NUMELS, run_allreduce

        args.numels = args.numels or DEFAULT_NUMELS
        run_allreduce(args)
        return 0
    torch.manual_seed(0)
    ceiling = local_copy_bandwidth() / 1e9
    print(f"{device_name()}, torch {torch.__version__}")
    print(f"device-to-device copy: {ceiling:,.0f} GB/s (read + write)", flush=True)
    if args.output_file:
        argv = sys.argv[1:] if argv is None else argv
        meta = {"command": shlex.join(["python", "benchmarks/kernel.py", *argv]),
                "date": datetime.now().astimezone().isoformat(timespec="seconds"),
                "commit": git_commit(), "device": device_name(), "copy_GBps": ceiling}  # fmt: skip
        args.output_file.write_text(json.dumps(meta, indent=2))
    run(args, ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
