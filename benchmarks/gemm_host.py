"""Host time of one GEMM call (torch.nn.functional.linear, bf16) at a token count met for the first
time against one met before: does a new extend step's token count cost the host (cuBLAS picking a
kernel for a new shape, the caching allocator), while the GPU waits?

    python benchmarks/gemm_host.py [--hidden 4096] [--out 28672]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def host_us(x: torch.Tensor, w: torch.Tensor) -> float:
    """Microseconds of host time for one call, the GPU idle when it starts."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.linear(x, w)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", type=int, default=28672, help="the gate/up projection of Llama-3.1-8B")
    ap.add_argument("--counts", type=int, default=24, help="new token counts to try")
    args = ap.parse_args()
    dev = "cuda"
    w = torch.randn(args.out, args.hidden, dtype=torch.bfloat16, device=dev)
    x = torch.randn(8192, args.hidden, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        host_us(x, w)
    seen = [host_us(x, w) for _ in range(10)]
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(1000, 8192, (args.counts,), generator=gen).tolist()
    new = [host_us(x[:m], w) for m in counts]
    again = [host_us(x[:m], w) for m in counts]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; F.linear [M, "
          f"{args.hidden}] x [{args.out}, {args.hidden}]^T, bf16; host us per call")  # fmt: skip
    for name, xs in (
        ("M = 8192, seen", seen),
        ("M new (24 counts)", new),
        ("the same M again", again),
    ):
        print(f"  {name:<22} median {statistics.median(xs):8.1f}  max {max(xs):8.1f}")
    print("  the new counts' calls in order:", " ".join(f"{u:.0f}" for u in new))


if __name__ == "__main__":
    main()
