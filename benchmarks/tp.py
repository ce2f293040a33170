"""Tensor-parallel serving benchmark: concurrent requests on a TP engine (TTFT, TPOT, throughput)
next to the per-GPU roofline, and batch-1 latency at several tp sizes.

    python benchmarks/tp.py --config benchmarks/configs/llama-3-70b --tp 2 \
        --num 32 --input-len 1000 --output-len 1000 \
        --latency-config benchmarks/configs/llama-3.1-8b --latency-tp 1 2

Dummy bf16 weights of the config (random, generated on each GPU). The roofline of one decode step
is what one GPU must read — its shard of the weights plus its kv heads' cache at the mean context —
divided by the device-to-device copy bandwidth measured in the same run; the all-reduces (two per
layer) are extra. On CPU (tiny configs, gloo) the same code runs for the smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_utils import copy_bandwidth, device_name, markdown_table, model_folder, parse_kv

import weft


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads (all of them but the input embedding's other rows)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = cfg["vocab_size"] * h  # lm_head; of the input embedding a step reads only its rows
    return (layers * per_layer + embed + h) * dtype_bytes


def kv_bytes_per_token(cfg: dict[str, Any], tp: int, dtype_bytes: int = 2) -> int:
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = max(1, cfg["num_key_value_heads"] // tp)
    return 2 * cfg["num_hidden_layers"] * kv_heads * d * dtype_bytes


async def one_request(
    engine: Any, ids: list[int], output_len: int, t0: float
) -> tuple[float, float, int]:
    """(TTFT, end time, output tokens) of one streamed request, times from t0."""
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    stream = await engine.async_generate(input_ids=ids, sampling_params=params, stream=True)
    first = None
    tokens = 0
    async for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
        tokens = chunk["meta_info"]["completion_tokens"]
    assert first is not None
    return first, time.perf_counter() - t0, tokens


async def concurrent_run(
    engine: Any, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one_request(engine, p, output_len, t0) for p in prompts))
    wall = time.perf_counter() - t0
    ttfts = [o[0] for o in outs]
    tpots = [(end - first) / max(1, n - 1) for first, end, n in outs]
    total = sum(o[2] for o in outs)
    return {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "tpot_median_ms": 1e3 * statistics.median(tpots),
        "tpot_p99_ms": 1e3 * float(np.percentile(tpots, 99)),
        "throughput_tok_s": total / wall,
        "wall_s": wall,
        "output_tokens": total,
    }


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, size=length).tolist() for _ in range(n)]


def start_engine(folder: Path, tp: int, args: argparse.Namespace, batch: int) -> Any:
    kwargs: dict[str, Any] = {
        "load_format": "dummy",
        "tp_size": tp,
        "max_running_requests": max(batch, 1),
        "context_length": args.context_length,
    }
    if torch.cuda.is_available():
        kwargs["cuda_graph_max_bs"] = max(batch, 1)
        kwargs["disable_cuda_graph"] = args.eager
    else:
        kwargs["cpu_threads"] = 1
    return weft.Engine(str(folder), **{**kwargs, **parse_kv(args.engine_arg)})


def throughput_part(
    args: argparse.Namespace, bandwidth: float | None, work: Path
) -> tuple[str, list[dict[str, Any]]]:
    """One engine (sized for the largest concurrency); each concurrency of --num in turn, with
    prompts of its own seed so no run hits another's cached prefixes."""
    folder, note = model_folder(args.config, work)
    cfg = json.loads((folder / "config.json").read_text())
    t_start = time.perf_counter()
    engine = start_engine(folder, args.tp, args, max(args.num))
    start_s = time.perf_counter() - t_start
    results = []
    try:
        engine.generate(input_ids=[11] * 16, sampling_params={"max_new_tokens": 4})
        for i, num in enumerate(args.num):
            prompts = random_prompts(num, args.input_len, cfg["vocab_size"], seed=100 + i)
            results.append(asyncio.run(concurrent_run(engine, prompts, args.output_len)))
    finally:
        engine.shutdown()
    mean_ctx = args.input_len + args.output_len / 2
    rows = []
    for num, res in zip(args.num, results, strict=True):
        step_bytes = weight_bytes(cfg) / args.tp + num * mean_ctx * kv_bytes_per_token(cfg, args.tp)
        roofline_ms = 1e3 * step_bytes / bandwidth if bandwidth else None
        ratio = res["tpot_median_ms"] / roofline_ms if roofline_ms else None
        rows.append([
            num,
            f"{res['ttft_median_s']:.2f} / {res['ttft_p99_s']:.2f}",
            f"{res['tpot_median_ms']:.2f} / {res['tpot_p99_ms']:.2f}",
            f"{res['throughput_tok_s']:,.0f}",
            _opt(roofline_ms),
            _opt(ratio, "x"),
        ])  # fmt: skip
    title = (
        f"{Path(args.config).name}, TP={args.tp}: {', '.join(map(str, args.num))} concurrent "
        f"requests, {args.input_len} in / {args.output_len} out ({note}; engine start incl. "
        f"dummy init + graph capture {start_s:.1f} s)"
    )
    head = ["concurrent", "TTFT median / p99 (s)", "TPOT median / p99 (ms)",
            "output throughput (tok/s)", "decode-step roofline per GPU (ms, no all-reduce)",
            "TPOT / roofline"]  # fmt: skip
    return f"**{title}**\n\n" + markdown_table(head, rows), results


def latency_part(args: argparse.Namespace, work: Path) -> str:
    folder, _ = model_folder(args.latency_config, work)
    cfg = json.loads((folder / "config.json").read_text())
    prompt = random_prompts(1, args.latency_input_len, cfg["vocab_size"], seed=1)
    rows = []
    for tp in args.latency_tp:
        engine = start_engine(folder, tp, args, 1)
        try:
            engine.generate(input_ids=prompt[0][:16], sampling_params={"max_new_tokens": 4})
            res = asyncio.run(concurrent_run(engine, prompt, args.latency_output_len))
        finally:
            engine.shutdown()
        rows.append([tp, f"{res['ttft_median_s'] * 1e3:.1f}", f"{res['tpot_median_ms']:.2f}"])
    title = (
        f"{Path(args.latency_config).name}, batch 1: {args.latency_input_len} in / "
        f"{args.latency_output_len} out"
    )
    return f"**{title}**\n\n" + markdown_table(["tp", "TTFT (ms)", "TPOT (ms)"], rows)


def _opt(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="benchmarks/configs/llama-3-70b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num", type=int, nargs="+", default=[32], help="concurrencies, one engine")
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--latency-config", default="benchmarks/configs/llama-3.1-8b")
    p.add_argument("--latency-tp", type=int, nargs="*", default=[1, 2])
    p.add_argument("--latency-input-len", type=int, default=128)
    p.add_argument("--latency-output-len", type=int, default=256)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE: an EngineConfig field"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    bandwidth = None
    if torch.cuda.is_available():
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
    parts = [
        f"date {datetime.date.today()}, {device_name()} x {torch.cuda.device_count()}, copy "
        f"bandwidth {bandwidth / 1e9:,.0f} GB/s"
        if bandwidth
        else f"date {datetime.date.today()}, {device_name()}",
        "command: python benchmarks/tp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_throughput:
            table, _ = throughput_part(args, bandwidth, Path(tmp))
            parts.append(table)
            print(table, flush=True)
        if args.latency_tp:
            table = latency_part(args, Path(tmp))
            parts.append(table)
    report = "\n\n".join(parts)
    print("\n" + report)
    return report


if __name__ == "__main__":
    main()
