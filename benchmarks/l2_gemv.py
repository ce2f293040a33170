"""Does a weight in the L2 make the skinny GEMV faster, and do L2 prefetch hints put it there?

    python benchmarks/l2_gemv.py [--rows 1 4] [--sleep-us 15]

For o_proj (4096 x 4096) and qkv (6144 x 4096) of Llama-3.1-8B, bf16: each graph replay runs,
per weight of eight, a 256 MiB write (the L2 flushed), then one of: nothing (cold); a read of the
weight (torch's sum: it lies in the L2 after); the L2 prefetch kernel (kernels/l2.py) and an idle
wait of --sleep-us, long enough for the lines to arrive; and then the GEMV. The same graphs
without the GEMV give the time to take off, so each row is the GEMV's own time.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from kernel_bench import copy_gbps, graph_ms

from weft.kernels.l2 import prefetch_l2
from weft.kernels.skinny import GemvLaunch, gemv

SHAPES = {"o_proj": (4096, 4096, GemvLaunch(64, 128, 1, 4, 6)),
          "qkv": (6144, 4096, GemvLaunch(64, 64, 1, 4, 8))}  # fmt: skip


def gemv_us(ws: list[torch.Tensor], rows: int, launch: GemvLaunch, cycles: int) -> list[str]:
    """The GEMV's own us over each weight of ws, per what ran before it (see the docstring)."""
    n, k = ws[0].shape
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.empty(len(ws), dtype=torch.bfloat16, device="cuda")
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    befores: dict[str, Callable[[int], object]] = {
        "cold": lambda i: None,
        "read just before": lambda i: sink[i].copy_(ws[i].sum()),
        "prefetched + wait": lambda i: (prefetch_l2(ws[i]), torch.cuda._sleep(cycles)),
        "wait only": lambda i: torch.cuda._sleep(cycles),
    }
    cells = []
    for label, before in befores.items():

        def body(with_gemv: bool, before: Callable[[int], object] = before) -> None:
            for i in range(len(ws)):
                flush.fill_(i)
                before(i)
                if with_gemv:
                    gemv(x, ws[i], out=out, launch=launch)

        ms = (graph_ms([lambda: body(True)]) - graph_ms([lambda: body(False)])) / len(ws)
        cells.append(f"{label} {ms * 1e3:5.1f}")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--sleep-us", type=float, default=15.0)
    args = ap.parse_args()
    ceiling = copy_gbps()
    cycles = int(args.sleep_us * 1980)  # NOTE: the H200's SM clock in runs, ~1.98 GHz
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s; us per GEMV (copy-speed "
          f"time of the weight in brackets)")  # fmt: skip
    for name, (n, k, launch) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(8)]
        for rows in args.rows:
            cells = gemv_us(ws, rows, launch, cycles)
            print(f"  {name:<7} rows {rows:2} [{n * k * 2 / ceiling / 1e3:4.1f}]: "
                  + " | ".join(cells))  # fmt: skip


if __name__ == "__main__":
    main()
