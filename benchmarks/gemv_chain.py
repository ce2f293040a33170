"""The skinny projections (weft.kernels.gemv) against cuBLAS as a decode step meets them: inside a
CUDA graph, back to back over distinct (cold) weights of Llama-3.1-8B's projection shapes and its
lm_head; first a one-row decode layer without attention (cuBLAS or GEMV, PDL or not).

    python benchmarks/gemv_chain.py [--rows 1 8 16] [--layers 12] [--layers-only] [--quick]
                                    [--shapes qkv o_proj] [--sum-launch]

Per shape and row count: microseconds per projection (the graph's time / layers) and the share
of the copy ceiling measured in the same run over the weight's bytes; every launch's output is
checked against a float32 reference first. cuBLAS's down projection runs after silu_and_mul's
own launch, as the model calls it; the GEMV's has SiLU-and-mul folded in.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from bench_utils import copy_bandwidth
from triton.runtime.errors import OutOfResources

from weft.kernels.activation import silu_and_mul
from weft.kernels.norm import fused_add_rmsnorm
from weft.kernels.reference import gemv_ref
from weft.kernels.skinny import GemvLaunch, gemv
from weft.runtime.executor.cuda_graph import replay_us

# (name, out features, in features, silu_mul): Llama-3.1-8B's projections
SHAPES = (
    ("qkv", 6144, 4096, False),
    ("o_proj", 4096, 4096, False),
    ("gate_up", 28672, 4096, False),
    ("down", 4096, 14336, True),
    ("lm_head", 128256, 4096, False),  # 1 GB: fewer copies (see --layers)
)
# (block_n, block_k, split_k, num_warps, num_stages)
LAUNCHES = [GemvLaunch(*c) for c in (
    (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (64, 128, 8, 4, 4),
    (64, 128, 1, 4, 3), (64, 128, 1, 4, 6), (64, 128, 4, 4, 6), (64, 256, 1, 4, 3),
    (64, 64, 1, 4, 8), (64, 64, 4, 4, 8), (128, 128, 1, 4, 4), (128, 128, 2, 4, 4),
    (128, 128, 4, 8, 4), (32, 128, 1, 4, 4), (32, 128, 2, 4, 4), (128, 64, 4, 4, 6),
)]  # fmt: skip
QUICK = LAUNCHES[:4]


def graph_us(op: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int) -> float:
    """Microseconds per op of one CUDA graph replay running op over every weight in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:  # compile and warm up outside the capture
            op(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            op(w)
    for _ in range(2):
        graph.replay()
    return replay_us(graph, reps) / len(weights)


def _name(launch: GemvLaunch) -> str:
    summed = (
        "" if launch.split_k == 1 else " summed here" if launch.sum_here else " summed by a launch"
    )
    return (f"n {launch.block_n:3} k {launch.block_k:4} split {launch.split_k} "
            f"warps {launch.num_warps} stages {launch.num_stages}{summed}")  # fmt: skip


# per shape, the launch for the layer chain (the gemv_chain winners on the H200)
LAYER_LAUNCHES = {
    "qkv": GemvLaunch(64, 64, 1, 4, 8),
    "o_proj": GemvLaunch(64, 128, 2, 4, 4),
    "gate_up": GemvLaunch(64, 128, 1, 4, 4),
    "down": GemvLaunch(128, 128, 4, 8, 4),
}


def bench_layers(layers: int, ceiling: float, reps: int) -> None:
    """A decode layer at one row without its attention: add + RMSNorm, qkv, o_proj (on q's
    columns), add + RMSNorm, gate_up, down; per layer, on distinct weights, in one graph."""
    dims = {name: (n, k) for name, n, k, _ in SHAPES}
    ws = [{name: torch.randn(*dims[name], dtype=torch.bfloat16, device="cuda") / dims[name][1] ** 0.5
           for name in LAYER_LAUNCHES} for _ in range(layers)]  # fmt: skip
    norm_w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    h = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    res = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    layer_bytes = sum(n * k * 2 for n, k in dims.values() if (n, k) != dims["lm_head"])
    copy_us = layer_bytes / ceiling * 1e6

    def layer(w: dict[str, torch.Tensor], gemv_on: frozenset[str], pdl: bool) -> None:
        def proj(name: str, x: torch.Tensor) -> torch.Tensor:
            if name in gemv_on:
                return gemv(x, w[name], silu_mul=name == "down", launch=LAYER_LAUNCHES[name],
                            pdl=pdl)  # fmt: skip
            return F.linear(silu_and_mul(x) if name == "down" else x, w[name])

        x = h.clone()
        fused_add_rmsnorm(x, res, norm_w, 1e-5, pdl=pdl)
        qkv = proj("qkv", x)
        o = proj("o_proj", qkv[:, :4096])
        fused_add_rmsnorm(o, res, norm_w, 1e-5, pdl=pdl)
        proj("down", proj("gate_up", o))

    print(f"\nlayer chain, 1 row, {layers} layers: copy speed {copy_us:.1f} us per layer")
    every = frozenset(LAYER_LAUNCHES)
    qkv_o = frozenset({"qkv", "o_proj"})
    variants = [  # (label, projections on the GEMV, programmatic dependent launches)
        ("cuBLAS", frozenset(), False),
        ("cuBLAS, norms as programmatic dependents", frozenset(), True),
        ("GEMV everywhere", every, False),
        ("GEMV everywhere, PDL", every, True),
        ("GEMV qkv + o_proj", qkv_o, False),
        ("GEMV qkv + o_proj, PDL", qkv_o, True),
    ]
    for label, gemv_on, pdl in variants:
        us = graph_us(lambda w, g=gemv_on, p=pdl: layer(w, g, p), ws, reps)
        print(f"  {us:7.1f} us per layer ({copy_us / us:4.0%} of copy speed)  {label}")
    del ws
    torch.cuda.empty_cache()


def bench_shape(name: str, n: int, k: int, silu: bool, rows_list: list[int], layers: int,
                launches: list[GemvLaunch], ceiling: float, reps: int) -> None:  # fmt: skip
    layers = max(2, min(layers, (4 << 30) // (n * k * 2)))  # at most ~4 GB of weights
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
               for _ in range(layers)]  # fmt: skip
    nbytes = n * k * 2
    copy_us = nbytes / ceiling * 1e6

    def cell(us: float) -> str:
        return f"{us:7.1f} us {copy_us / us:5.0%}"

    print(f"\n{name} [{n} x {k}]: copy speed {copy_us:.1f} us")
    for rows in rows_list:
        x = torch.randn(rows, 2 * k if silu else k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        want = gemv_ref(x, weights[0], None, silu)
        cublas = graph_us(lambda w, x=x: F.linear(silu_and_mul(x) if silu else x, w), weights, reps)
        line = f"  rows {rows}: cuBLAS {cell(cublas)}"
        if silu:
            plain = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
            alone = graph_us(lambda w, plain=plain: F.linear(plain, w), weights, reps)
            line += f" (linear alone {cell(alone)})"
        print(line)
        timed = []
        for launch in launches:
            try:
                got = gemv(x, weights[0], silu_mul=silu, out=out, launch=launch).float()
            except OutOfResources:
                print(f"    {launch}: out of shared memory")
                continue
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{name} rows {rows} {launch}: relative error {err:.3g}"

            def run(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out,
                    launch: GemvLaunch = launch) -> torch.Tensor:  # fmt: skip
                return gemv(x, w, silu_mul=silu, out=out, launch=launch)

            us = graph_us(run, weights, reps)
            timed.append((us, launch))
        timed.sort(key=lambda t: t[0])
        for _us, launch in timed[:3]:  # the best three again, as programmatic dependents

            def run_pdl(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out,
                        launch: GemvLaunch = launch) -> torch.Tensor:  # fmt: skip
                return gemv(x, w, silu_mul=silu, out=out, launch=launch, pdl=True)

            print(f"    {cell(graph_us(run_pdl, weights, reps))}  {_name(launch)} PDL")
        for us, launch in timed:
            print(f"    {cell(us)}  {_name(launch)}")
    del weights
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--layers", type=int, default=12, help="distinct weights per graph")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--layers-only", action="store_true", help="only the layer chain")
    parser.add_argument("--quick", action="store_true", help="the first four launches only")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES],
                        help="only these projections (default: all)")  # fmt: skip
    parser.add_argument("--sum-launch", action="store_true",
                        help="split-K launches also with their sum in a launch of its own")  # fmt: skip
    args = parser.parse_args()
    assert torch.cuda.is_available(), "benchmarks/gemv_chain.py needs CUDA"
    torch.manual_seed(0)
    ceiling = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {ceiling / 1e9:,.0f} GB/s, bf16, "
          f"{args.layers} weights per graph")  # fmt: skip
    bench_layers(args.layers, ceiling, args.reps)
    if args.layers_only:
        return
    launches = QUICK if args.quick else LAUNCHES
    if args.sum_launch:
        launches = launches + [replace(c, sum_here=False) for c in launches if c.split_k > 1]
    for name, n, k, silu in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        bench_shape(name, n, k, silu, args.rows, args.layers, launches, ceiling, args.reps)


if __name__ == "__main__":
    main()
