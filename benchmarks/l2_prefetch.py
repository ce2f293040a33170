"""L2 weight prefetch on the GPU: does a projection GEMM run faster when its weight was prefetched
into the L2 during a light window before it, and how do small decode steps change with it?

    python benchmarks/l2_prefetch.py micro     # one GEMM after a flushed L2, in CUDA graphs
    python benchmarks/l2_prefetch.py steps --plans off on "qkv:o_proj" ...  # decode steps

`micro` times, per replay of a graph: flush the L2 (read 256 MiB), a window of idle SMs
(`torch.cuda._sleep`) standing for the norms, rotary and attention between two GEMMs, then the
GEMM. The prefetch, forked onto a side stream before the window, runs during it. The GEMM's time
is the replay's time less that of the same graph without the GEMM. `steps` builds the
Llama-3.1-8B runner (dummy weights) once and captures its decode graphs once per plan
(runtime/models/prefetch.py), timing each batch as one_batch.py does, next to its roofline.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_utils import copy_bandwidth

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"o_proj": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336)}


def graph_us(body: Callable[[], None], inner: int = 20, reps: int = 7) -> float:
    """Microseconds per call of `body`, captured `inner` times in one graph; median of reps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            body()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


def sleep_cycles_per_us() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def micro(args: argparse.Namespace) -> None:
    from weft.kernels.prefetch import l2_prefetch

    dev = torch.device("cuda")
    bw = copy_bandwidth()  # bytes read + written per second: the rooflines' read speed
    print(f"copy: {bw / 1e12:.2f} TB/s read+write; L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MiB")  # fmt: skip
    cycles = sleep_cycles_per_us()
    print(f"_sleep: {cycles:.0f} cycles per us")
    flush = torch.empty(64 << 20, dtype=torch.float32, device=dev)  # read: leaves clean lines
    side = torch.cuda.Stream()
    print("| weight | rows | window us | prefetch | GEMM us | vs cold | weight at copy speed us |")
    print("|---|---|---|---|---|---|---|")
    for name in args.weights:
        n, k = SHAPES[name]
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
        at_copy = w.numel() * 2 / bw * 1e6
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
            for window in args.windows:
                spin = int(window * cycles)

                def step(
                    gemm: bool, fetch: dict[str, Any] | None, w: torch.Tensor = w,
                    x: torch.Tensor = x, spin: int = spin,
                ) -> Callable[[], None]:  # fmt: skip
                    def body() -> None:
                        flush.sum()
                        if fetch is not None:
                            side.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(side):
                                l2_prefetch(w, **fetch)
                        if spin:
                            torch.cuda._sleep(spin)
                        if gemm:
                            F.linear(x, w)
                        if fetch is not None:
                            torch.cuda.current_stream().wait_stream(side)

                    return body

                base = graph_us(step(False, None))
                cold = graph_us(step(True, None)) - base
                print(f"| {name} | {rows} | {window} | none | {cold:.1f} | 1.00 | {at_copy:.1f} |")
                for chunk in args.chunks:
                    for evict_last in (True, False):
                        fetch = {"chunk": chunk, "evict_last": evict_last}
                        base_pf = graph_us(step(False, fetch))
                        t = graph_us(step(True, fetch)) - base_pf
                        label = f"{chunk >> 10} KiB{' evict_last' if evict_last else ''}"
                        extra = base_pf - base
                        print(f"| {name} | {rows} | {window} | {label} (+{extra:.1f} us alone) "
                              f"| {t:.1f} | {t / cold:.2f} | {at_copy:.1f} |")  # fmt: skip


def steps(args: argparse.Namespace) -> None:
    os.environ["WEFT_L2_PREFETCH"] = "off"  # the runner's own graphs: none; each plan's below
    from one_batch import decode_batch, pipelined, timed

    from weft.runtime.config import EngineConfig
    from weft.runtime.cuda_graph import GraphRunner
    from weft.runtime.loader import read_hf_config
    from weft.runtime.model_runner import ModelRunner
    from weft.runtime.models.prefetch import DEFAULT_PLAN, PrefetchPlan

    bw = copy_bandwidth()
    print(f"copy: {bw / 1e12:.2f} TB/s read+write")
    folder = Path(args.config)
    hf = read_hf_config(folder)
    max_batch = max(args.batches)
    ctx = args.context + 16
    config = EngineConfig(
        model=str(folder), load_format="dummy", attention_backend="triton",
        cuda_graph_max_bs=max_batch, max_running_requests=max(max_batch, 32),
        max_total_tokens=(max(max_batch, 32) + 2) * (ctx + 32), context_length=max(ctx, 1040),
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    runner = ModelRunner(config, folder, hf, config.context_length or ctx)
    model: Any = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    kv_per_token = runner.pool.bytes_per_slot(
        hf.num_hidden_layers, runner.pool.num_kv_heads, runner.pool.head_dim,
        runner.pool.k[0].dtype,
    )  # fmt: skip
    print("| plan | batch | step ms (waited) | pipelined ms | roofline ms | x roofline |")
    print("|---|---|---|---|---|---|")
    for text in args.plans:
        runner.graphs = None
        torch.cuda.empty_cache()
        graphs = GraphRunner(model, runner.attn, max_batch, hf.hidden_size, runner.dtype,
                             runner.device, pad_row=0)  # fmt: skip
        if text != "off":
            plan = PrefetchPlan.parse(DEFAULT_PLAN if text == "on" else text, max_batch)
            graphs.prefetcher = model.enable_prefetch(plan)
        else:
            model.prefetcher = None
        graphs.capture()
        runner.graphs = graphs
        for b in args.batches:
            batch = decode_batch(runner, b, args.context, hf.vocab_size)
            t = timed(runner, batch, args.reps)
            t_pipe = pipelined(runner, batch, max(args.reps, 10))
            step_bytes = weight_bytes - embed_bytes + b * embed.shape[1] * embed.element_size()
            roof = (step_bytes + b * (args.context + 1) * kv_per_token) / bw
            print(f"| {text} | {b} | {t * 1e3:.3f} | {t_pipe * 1e3:.3f} | {roof * 1e3:.3f} | "
                  f"{t_pipe / roof:.3f} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--weights", nargs="+", default=["o_proj", "qkv"], choices=sorted(SHAPES))
    m.add_argument("--rows", type=int, nargs="+", default=[1])
    m.add_argument("--windows", type=float, nargs="+", default=[0, 5, 10, 15])
    m.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 65536])
    s = sub.add_parser("steps")
    s.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3.1-8b"))
    s.add_argument("--plans", nargs="+", default=["off", "on", "off"])
    s.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    s.add_argument("--context", type=int, default=2048)
    s.add_argument("--reps", type=int, default=20)
    s.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    micro(args) if args.mode == "micro" else steps(args)


if __name__ == "__main__":
    main()
