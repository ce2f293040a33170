"""One batch on the ModelRunner (no server): decode steps and prefills against their roofline, and
where a step's time goes.

    python benchmarks/step.py decode [--backends triton+graph flashinfer+graph] [--batches 1 64]
    python benchmarks/step.py decode --variant "gemv off:tuning.gemv=off" --rounds 2
    python benchmarks/step.py prefill [--backends triton]
    python benchmarks/step.py profile [--batches 1 64]        # kernels of a decode step by GPU time
    python benchmarks/step.py scheduler [--num-prompts 256]   # host vs model time per step
    python benchmarks/step.py decode --config benchmarks/configs/qwen2.5-coder-1.5b \
        --batches 1 32 --variant "bf16:" --variant "gguf q4_k_m:quantization=gguf"
    python benchmarks/step.py decode --batches 1 64 --variant "base:" \
        --variant "lora x8:enable_lora=true,max_lora_rank=16,max_loras_per_batch=8" \
        --variant "lora x8 n1:enable_lora=true,max_lora_rank=16,max_loras_per_batch=8,lora_launch=64/1/4"

Dummy bf16 weights of a real config (default benchmarks/configs/llama-3.1-8b), initialised on the
GPU (`quantization=gguf` as a variant: random GGUF blocks in llama.cpp's Q4_K_M layout, kept
quantized); page size 16. `decode`: per attention backend ('+graph': decode replayed from CUDA graphs)
and variant (engine arguments on top of --engine-arg, each a fresh runner), a decode step of each
batch size with --context tokens of KV per request, timed two ways: waiting for each step (host
work included) and pipelined, step after step as overlap scheduling runs them (the host work of
one step hidden behind the GPU's: the figure BENCHMARKS.md reports). Its roofline is the bytes
the step must read, (weights + the batch's KV) / the device-to-device copy bandwidth measured in
the same run; the input embedding counts only the batch's rows. A variant with `enable_lora`
fills its LoRA pool with max_loras_per_batch random adapters of max_lora_rank on every projection
and spreads each batch over all of them (request i under adapter i mod n): a mixed-adapter
batch, beside the base model's step (which is also the merged adapter's: merging adds no work);
a variant's `lora_launch=BLOCK_N/N_ITERS/WARPS[/SPLIT_DIV]` (not an engine argument) runs the LoRA
kernels of decode batches under that launch (offline_lora.forced_lora_launch).
`prefill`: 1 × 1024 and 32 × 1024 tokens, TFLOP/s at 2 FLOP per weight per token. CUDA events,
medians after warm-up. On a machine without CUDA (`--backends torch`, a tiny --config) both run as
a smoke test against the CPU's copy.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from bench_utils import (
    Stopwatch,
    device_name,
    git_commit,
    local_copy_bandwidth,
    markdown_table,
    merge_kwargs,
)
from bench_utils import parse_kv as parse_engine_args
from offline_lora import forced_lora_launch, random_adapters, spread_adapters
from step_profile import add_profile_args, decode_batch, make_reqs, run_profile

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.loader import read_hf_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "benchmarks/configs/llama-3.1-8b"

##### The roofline #####


def step_weight_bytes(param_bytes: int, embed_bytes: int, row_bytes: int, batch: int,
                      tied: bool) -> int:  # fmt: skip
    """Weight bytes a decode step reads: every parameter once, but of an untied input embedding
    only the batch's rows."""
    return param_bytes if tied else param_bytes - embed_bytes + batch * row_bytes


def decode_roofline_s(weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int,
                      bandwidth: float) -> float:  # fmt: skip
    """Seconds a decode step takes at copy speed: its weights plus each request's KV (context +
    the new token) read once, at `bandwidth` bytes per second (read + write, as copies count)."""
    return (weight_bytes + batch * (context + 1) * kv_bytes_per_token) / bandwidth


##### Batches and timers #####


def timed(runner: ModelRunner, batch: Batch, reps: int) -> float:
    """Median seconds of one step, waiting for its tokens (host work included)."""
    for _ in range(2):
        runner.forward(batch)
    watch, times = Stopwatch(runner.device), []
    for _ in range(reps):
        watch.start()
        runner.forward(batch)
        times.append(watch.stop())
    return statistics.median(times)


def pipelined(runner: ModelRunner, batch: Batch, reps: int) -> float:
    """Seconds per decode step with steps back to back as overlap scheduling runs them: step t+1
    is launched (and samples) before step t's tokens are read. The median of 3 runs of `reps`
    steps. The same batch runs each time: its token ids come from the host."""
    for _ in range(2):
        runner.forward(batch)
    watch, times = Stopwatch(runner.device), []
    for _ in range(3):
        prev = None
        watch.start()
        for _ in range(reps):
            step = runner.launch(batch)
            runner.sample(step)
            if prev is not None:
                prev.resolve()
            prev = step
        assert prev is not None
        prev.resolve()
        times.append(watch.stop() / reps)
    return statistics.median(times)


##### Runners #####


def engine_kwargs(backend: str, args: argparse.Namespace, **sizes: Any) -> dict[str, Any]:
    """EngineConfig keywords of one runner: dummy weights of --config, the backend ('+graph':
    CUDA graphs), the sizes the batches need, then --engine-arg on top."""
    name, graph = backend.removesuffix("+graph"), backend.endswith("+graph")
    base = {"model": str(args.config), "load_format": "dummy", "attention_backend": name,
            "disable_cuda_graph": not graph, **sizes}  # fmt: skip
    return merge_kwargs(base, args.engine_arg)


def build_runner(kwargs: dict[str, Any]) -> ModelRunner:
    config = EngineConfig.from_kwargs(**kwargs)
    hf = read_hf_config(Path(kwargs["model"]))
    return ModelRunner(config, Path(kwargs["model"]), hf, config.context_length or 4096)


def release() -> None:
    """Give the memory of a dropped runner (its graphs, pool, weights) back before the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_sizes(runner: ModelRunner) -> tuple[int, int, int, bool]:
    """(all parameters' bytes, the input embedding's bytes, one embedding row's, tied): the
    memory the weights take on the device (quantized ones as their blocks)."""
    model: Any = runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = sum(p.numel() * p.element_size() for p in model.embed_tokens.parameters())
    row = embed // model.embed_tokens.per_rank
    return params, embed, row, bool(model.tie_word_embeddings)


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """('default', {}) and each --variant NAME:KEY=VALUE,..., --rounds times over (a, b, a, b)."""
    named: list[tuple[str, dict[str, Any]]] = [] if args.variant else [("default", {})]
    for text in args.variant:
        name, _, pairs = text.partition(":")
        named.append((name, parse_engine_args(pairs.split(",")) if pairs else {}))
    return named * args.rounds


def run_decode(args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:
    hf = read_hf_config(Path(args.config))
    max_batch = max(args.batches)
    sizes = {"cuda_graph_max_bs": max_batch, "max_running_requests": max(max_batch, 32),
             "max_total_tokens": (max_batch + 2) * (args.context + 64),
             "context_length": args.context + 64}  # fmt: skip
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        for name, over in variants(args):
            label = backend if name == "default" else f"{backend} {name}"
            over = dict(over)
            try:
                with forced_lora_launch(over.pop("lora_launch", None)):
                    rows += decode_rows(args, label, backend, merge_kwargs(
                        engine_kwargs(backend, args, **sizes), over), hf, bandwidth)  # fmt: skip
            except Exception as e:  # report it and go on with the other backends
                rows.append(report({"backend": label, "error": f"{type(e).__name__}: {e}"}))
            release()
    return rows


def decode_rows(args: argparse.Namespace, label: str, backend: str, kwargs: dict[str, Any],
                hf: Any, bandwidth: float) -> list[dict[str, Any]]:  # fmt: skip
    """One runner of `kwargs`: a row per batch size."""
    runner = build_runner(kwargs)
    params, embed, row, tied = weight_sizes(runner)
    kv = runner.pool.bytes_per_slot(hf.num_hidden_layers, runner.pool.num_kv_heads,
                                    runner.pool.head_dim, runner.pool.k[0].dtype)  # fmt: skip
    adapters = random_adapters(runner)
    rows = []
    for b in args.batches:
        batch = spread_adapters(decode_batch(runner, b, args.context, hf.vocab_size), adapters)
        t, t_pipe = timed(runner, batch, args.reps), pipelined(runner, batch, args.reps)
        weights = step_weight_bytes(params, embed, row, b, tied)
        roof = decode_roofline_s(weights, kv, b, args.context, bandwidth)
        rows.append(report({"backend": label, "attention": backend, "batch": b,
                            "context": args.context, "adapters": len(adapters),
                            "weights_MiB": params / 2**20,
                            "ms": t * 1e3, "pipelined_ms": t_pipe * 1e3,
                            "roofline_ms": roof * 1e3, "x_roofline": t_pipe / roof}))  # fmt: skip
    return rows


def run_prefill(args: argparse.Namespace) -> list[dict[str, Any]]:
    hf = read_hf_config(Path(args.config))
    sizes = {"max_total_tokens": 34 * 1100, "max_running_requests": 32, "context_length": 1100}
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        runner = None
        try:
            runner = build_runner(engine_kwargs(backend, args, **sizes))
            params, embed, _, tied = weight_sizes(runner)
            flop_bytes = params - (0 if tied else embed)  # 2 FLOP per 2-byte weight per token
            for n in (1, 32):
                reqs = make_reqs(runner, n, 1024, hf.vocab_size)
                t = timed(runner, Batch(ForwardMode.EXTEND, reqs, [1024] * n), args.reps)
                rows.append(report({"backend": backend, "prefill": f"{n}x1024", "ms": t * 1e3,
                                    "TFLOP/s": flop_bytes * 1024 * n / t / 1e12}))  # fmt: skip
        except Exception as e:
            rows.append(report({"backend": backend, "error": f"{type(e).__name__}: {e}"}))
        runner = None
        release()
    return rows


def report(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)  # fmt: skip
    return row


def decode_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per backend (and variant) and batch, pipelined ms against the roofline
    and against the first variant's step (same attention backend and batch)."""
    head = ["backend", "batch × context", "pipelined ms", "waited ms", "roofline ms", "× roofline",
            "× first variant", "weights MiB"]  # fmt: skip
    ok = [r for r in rows if "error" not in r]
    first: dict[tuple[str, int], float] = {}
    for r in ok:
        first.setdefault((r["attention"], r["batch"]), r["pipelined_ms"])
    body = [[r["backend"], f"{r['batch']} × {r['context']}", f"{r['pipelined_ms']:.3f}",
             f"{r['ms']:.3f}", f"{r['roofline_ms']:.3f}", f"{r['x_roofline']:.3f}",
             f"{r['pipelined_ms'] / first[r['attention'], r['batch']]:.3f}",
             f"{r['weights_MiB']:.1f}"] for r in ok]  # fmt: skip
    body += [[r["backend"], "-", r["error"], "", "", "", "", ""] for r in rows if "error" in r]
    return markdown_table(head, body)


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=CONFIG, help="a folder with config.json")
    common.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig field for every runner (tuning.gemv=off, ...)")  # fmt: skip
    common.add_argument("--output-file", type=Path, help="JSON results")
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="what", required=True)
    dec = sub.add_parser("decode", parents=[common], help="decode steps against the roofline")
    dec.add_argument("--backends", nargs="+", default=["triton+graph"],
                     help="attention backends; '+graph' replays decode in CUDA graphs")  # fmt: skip
    dec.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    dec.add_argument("--context", type=int, default=2048, help="KV tokens per request")
    dec.add_argument("--reps", type=int, default=20, help="steps per timing (medians)")
    dec.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                     help="a runner with these engine arguments too (replaces 'default')")  # fmt: skip
    dec.add_argument("--rounds", type=int, default=1, help="times the variants run, in turn")
    pre = sub.add_parser("prefill", parents=[common], help="1x1024 and 32x1024 prefills")
    pre.add_argument("--backends", nargs="+", default=["triton"])
    pre.add_argument("--reps", type=int, default=10)
    add_profile_args(sub, common)
    args = ap.parse_args(argv)
    args.engine_arg = parse_engine_args(args.engine_arg)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.what in ("profile", "scheduler"):
        run_profile(args)
        return 0
    bandwidth = local_copy_bandwidth()  # (on CPU, with the torch backend: a smoke run)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"{device_name()}: device-to-device copy {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows = run_decode(args, bandwidth) if args.what == "decode" else run_prefill(args)
    if args.what == "decode":
        print("\n" + decode_table(rows))
    if args.output_file:
        argv = sys.argv[1:] if argv is None else argv
        meta = {"command": shlex.join(["python", "benchmarks/step.py", *argv]),
                "date": datetime.now().astimezone().isoformat(timespec="seconds"),
                "commit": git_commit(), "device": device_name(), "copy_GBps": bandwidth / 1e9}  # fmt: skip
        args.output_file.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
