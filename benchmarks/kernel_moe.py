"""The fused MoE kernel against moe_ref's loop over experts on CUDA, per token count, with the GB/s of
the bytes it must move against the copy ceiling measured in the same run; fused_moe also back to
back in a CUDA graph (no launch cost: what a captured decode step pays; the same weights each
call, so the L2 may hold some of them where they are small); and align_pairs alone in a CUDA graph,
its one-launch _align_kernel against its ~20 torch ops.

    python benchmarks/kernel_moe.py                                 # Qwen3-30B-A3B, T 1 8 64 256
    python benchmarks/kernel_moe.py --experts 8 --top-k 2 --hidden 4096 --inter 14336  # Mixtral

Times are medians of triton.testing.do_bench (L2 flushed between calls). The bytes are the
distinct selected experts' w13 and w2, x read and out written: what a kernel that reads each
selected weight once must move, read plus written, as the copy ceiling counts.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from kernel_util import graph_us

DEV = "cuda"


def bench_moe(
    ceiling: float, experts: int, top_k: int, hidden: int, inter: int, tokens_list: list[int]
) -> None:
    """One line per token count: fused_moe and moe_ref in microseconds, the speedup, and each
    one's GB/s (and share of the ceiling, in GB/s) of the bytes that must move."""
    import triton.testing

    from weft.kernels.moe import default_launch, fused_moe
    from weft.kernels.moe_ref import moe_ref, select_experts

    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV).div_(hidden**0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, device=DEV).div_(inter**0.5).bfloat16()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(f"\nE={experts} K={top_k} H={hidden} I={inter} bf16: "
          f"{expert_bytes / 1e6:.1f} MB per expert")  # fmt: skip
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=DEV).bfloat16()
        weights, ids = select_experts(torch.randn(tokens, experts, device=DEV), top_k, True)
        out = torch.empty_like(x)
        want = moe_ref(x, w13, w2, weights, ids)
        got = fused_moe(x, w13, w2, weights, ids, out=out)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"T={tokens}: relative error {err:.3g} against moe_ref"
        fused = triton.testing.do_bench(partial(fused_moe, x, w13, w2, weights, ids, out=out))
        naive = triton.testing.do_bench(partial(moe_ref, x, w13, w2, weights, ids))
        graphed = graph_us(partial(fused_moe, x, w13, w2, weights, ids, out=out))
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * x.numel() * x.element_size()
        fused_gbs, naive_gbs = nbytes / fused / 1e6, nbytes / naive / 1e6  # ms -> GB/s
        print(f"  T {tokens:4} ({distinct:3} experts, {nbytes / 1e6:7.1f} MB): "
              f"fused {fused * 1e3:8.1f} us {fused_gbs:6.0f} GB/s ({fused_gbs / ceiling:4.0%}) | "
              f"moe_ref {naive * 1e3:8.1f} us {naive_gbs:6.0f} GB/s ({naive_gbs / ceiling:4.0%}) "
              f"| speedup {naive / fused:5.1f}x | fused in a graph {graphed:7.1f} us "
              f"{nbytes / graphed / 1e3:6.0f} GB/s  [{default_launch(tokens, hidden, inter, top_k, experts)}]",
              flush=True)  # fmt: skip


def bench_align(experts: int, top_k: int, hidden: int, inter: int, tokens_list: list[int]) -> None:
    """One line per token count: align_pairs's two paths in a CUDA graph (what a captured step pays
    for them), checked equal; `*` marks the one align_pairs takes."""
    from weft.kernels import moe
    from weft.kernels.moe_ref import select_experts

    print(f"\nalign_pairs in a graph (E={experts} K={top_k}; fused up to "
          f"{moe.FUSED_ALIGN_MAX_PAIRS} pairs):")  # fmt: skip
    for tokens in tokens_list:
        ids = select_experts(torch.randn(tokens, experts, device=DEV), top_k, True)[1]
        block_m = moe.default_launch(tokens, hidden, inter, top_k, experts).block_m
        fused = moe._align_pairs_fused(ids, experts, block_m)
        for name, got, want in zip(moe.MoeAlignment._fields, fused,
                                   moe._align_pairs_torch(ids, experts, block_m), strict=True):  # fmt: skip
            assert torch.equal(got, want), f"T={tokens}: fused align_pairs differs in {name}"
        fused_us = graph_us(partial(moe._align_pairs_fused, ids, experts, block_m))
        torch_us = graph_us(partial(moe._align_pairs_torch, ids, experts, block_m))
        mark = ("*", " ") if tokens * top_k <= moe.FUSED_ALIGN_MAX_PAIRS else (" ", "*")
        print(f"  T {tokens:4} ({tokens * top_k:5} pairs, block_m {block_m:2}): "
              f"fused{mark[0]} {fused_us:6.1f} us | torch{mark[1]} {torch_us:6.1f} us | "
              f"saved {torch_us - fused_us:6.1f} us", flush=True)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--experts", type=int, default=128, help="E (Qwen3-30B-A3B: 128)")
    ap.add_argument("--top-k", type=int, default=8, help="K (Qwen3-30B-A3B: 8)")
    ap.add_argument("--hidden", type=int, default=2048, help="H (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--inter", type=int, default=768, help="I per expert (Qwen3-30B-A3B: 768)")
    args = ap.parse_args(argv)
    if not 1 <= args.top_k <= args.experts:
        ap.error(f"--top-k must be in [1, --experts], got {args.top_k} of {args.experts}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_moe.py needs CUDA", file=sys.stderr)
        return 2
    from bench_utils import device_name, local_copy_bandwidth

    torch.manual_seed(0)
    ceiling = local_copy_bandwidth() / 1e9
    print(f"{device_name()}, torch {torch.__version__}")
    print(f"device-to-device copy: {ceiling:,.0f} GB/s (read + write)", flush=True)
    bench_moe(ceiling, args.experts, args.top_k, args.hidden, args.inter, args.tokens)
    bench_align(args.experts, args.top_k, args.hidden, args.inter, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
