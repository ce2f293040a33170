"""One batch, no server: prefill and decode step times of the ModelRunner next to their roofline.

    python benchmarks/one_batch.py [--config benchmarks/configs/llama-3.1-8b] [--backends ...]

Random (dummy) bf16 weights of a real config, initialised on the GPU. For each attention backend:
prefill time for 1x1024 and 32x1024 tokens; decode step time at batch 1, 8, 32, 64, 128, 256 with
2048-token contexts. Each decode step is shown next to its roofline — (weight bytes + KV bytes read)
/ the device-to-device copy bandwidth measured in the same run — and as a fraction of it. The
input embedding counts only the batch's rows (a step reads no others; it counted whole until the
sixth session, which flattered the ratio by ~0.25 ms at Llama-3.1-8B's 1 GB table). A decode
step is timed twice: waiting for each step (host work included) and pipelined, step after step as
overlap scheduling runs them (the host work of one step hidden behind the GPU's work).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_utils import copy_bandwidth

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.loader import read_hf_config
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req

REPO = Path(__file__).resolve().parents[1]


def make_reqs(runner: ModelRunner, n: int, prompt_len: int, vocab: int) -> list[Req]:
    """n requests whose table rows point at private slots (KV content is irrelevant to timing)."""
    reqs = []
    p = runner.page_size
    span = -(-(prompt_len + 8) // p) * p  # whole pages: position i sits at offset i % page_size
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        req = Req(rid=str(i), input_ids=ids, params=SamplingParams(temperature=0), max_new_tokens=8)
        req.row = i
        base = runner.page_size + i * span  # skip the reserved page
        runner.req_to_token.table[i, :span] = torch.arange(base, base + span)
        reqs.append(req)
    return reqs


def decode_batch(runner: ModelRunner, n: int, context: int, vocab: int) -> Batch:
    """A decode step of n requests, each with `context` tokens in its KV and one new token."""
    reqs = make_reqs(runner, n, context, vocab)
    for r in reqs:
        r.output_ids = [1]
        r.kv_len = context
    return Batch(ForwardMode.DECODE, reqs, [1] * n)


def timed(runner: ModelRunner, batch: Batch, reps: int) -> float:
    for _ in range(2):
        runner.forward(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pipelined(runner: ModelRunner, batch: Batch, reps: int) -> float:
    """Seconds per decode step with steps back to back as overlap scheduling runs them: step t+1
    is launched (and samples) before step t's tokens are read, so the host work of a step hides
    behind the GPU's. (`timed` waits for each step, host work included.) The same batch runs
    each time: its token ids come from the host, not from the step before."""
    for _ in range(2):
        runner.forward(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        prev = None
        start.record()
        for _ in range(reps):
            step = runner.launch(batch)
            runner.sample(step)
            if prev is not None:
                prev.resolve()
            prev = step
        end.record()
        assert prev is not None
        prev.resolve()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def _gemv_picks(runner: ModelRunner) -> str:
    """Per projection shape, the decode sizes whose graphs run the skinny GEMV and its launch."""
    assert runner.graphs is not None
    return str({shape: {n: tuple(vars(launch).values()) for n, launch in sizes.items()}
                for shape, sizes in runner.graphs.gemv.items()})  # fmt: skip


def _prefetch_ok(value: str) -> bool:
    at, _, fraction = value.partition(":")
    try:
        return at in ("off", "start", "end") and 0 < float(fraction or 1) <= 1
    except ValueError:
        return False


# a step mode's settings (KEY=VALUE): the check of VALUE, what it switches, whether it is one of
# the triton backend's own
SETTINGS: dict[str, tuple[Any, str, bool]] = {
    "gemv": (("auto", "on", "off").__contains__, "WEFT_GEMV", False),
    "norm": (("fold", "launch").__contains__, "WEFT_FOLD_NORM (on: fold): the RMSNorms folded "
             "into the skinny GEMVs or launched", False),
    "sum": (("here", "launch").__contains__, "WEFT_SPLIT_SUM (GEMV and decode)", False),
    "rope": (("fused", "separate").__contains__, "rotary in the decode kernel or not", True),
    "attn": (("plain", "pdl", "wait").__contains__, "decode kernels as programmatic dependents "
             "(wait: the split kernel waits, and lets the next kernel launch only as it ends)",
             True),
    "warps": (("auto", "2", "4").__contains__, "the decode kernel's warps", True),
    "prefetch": (_prefetch_ok, "off|start|end[:FRACTION]: o_proj's weight asked of the L2 by "
                 "the rotating decode kernel", True),
}  # fmt: skip


def parse_mode(mode: str) -> dict[str, str]:
    """'KEY=VALUE[,KEY=VALUE...]' -> its settings; ValueError names what is wrong."""
    settings: dict[str, str] = {}
    for item in mode.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in SETTINGS:
            raise ValueError(f"{item!r} is not KEY=VALUE with KEY one of {sorted(SETTINGS)}")
        if not SETTINGS[key][0](value):
            raise ValueError(f"{key}={value!r}: {SETTINGS[key][1]} takes no such value")
        settings[key] = value
    return settings


def _defaults(runner: ModelRunner) -> dict[str, Any]:
    """The switches a step mode may set, as the runner was built (each mode starts from them)."""
    graphs: Any = runner.graphs
    names = ("gemv_mode", "sum_here", "fold_norms")
    attn = ("sum_here", "decode_warps", "l2_prefetch", "l2_prefetch_fraction", "l2_prefetch_bs",
            "fuse_rope", "pdl", "pdl_trigger")  # fmt: skip
    return {"graphs": {n: getattr(graphs, n) for n in names},
            "attn": {n: getattr(runner.attn, n) for n in attn if hasattr(runner.attn, n)}}  # fmt: skip


def apply_mode(runner: ModelRunner, settings: dict[str, str], defaults: dict[str, Any],
               prefetch_bs: int) -> None:  # fmt: skip
    graphs: Any = runner.graphs
    attn: Any = runner.attn  # the triton backend's switches for its own keys
    for obj, key in ((graphs, "graphs"), (attn, "attn")):
        for name, value in defaults[key].items():
            setattr(obj, name, value)
    for key, value in settings.items():
        if key == "gemv":
            graphs.gemv_mode = value
        elif key == "norm":  # WEFT_FOLD_NORM: where the decode graphs' projections run the GEMV
            graphs.fold_norms = value == "fold"
        elif key == "sum":  # who sums split K (GEMV) and split KV (decode attention)
            graphs.sum_here = attn.sum_here = value == "here"
        elif key == "warps":  # the decode kernel's warps (auto: its default)
            attn.decode_warps = None if value == "auto" else int(value)
        elif key == "prefetch":  # the L2 prefetch of o_proj's weight (off: none)
            at, _, fraction = value.partition(":")
            attn.l2_prefetch = "" if at == "off" else at
            attn.l2_prefetch_fraction = float(fraction or 1.0)
            attn.l2_prefetch_bs = prefetch_bs
        elif key == "rope":
            attn.fuse_rope = value == "fused"
        else:
            attn.pdl, attn.pdl_trigger = value != "plain", value == "pdl"


def run_backend(args: argparse.Namespace, backend: str, bandwidth: float) -> list[dict[str, Any]]:
    folder = Path(args.config)
    hf = read_hf_config(folder)
    ctx = args.context + 16
    max_batch = max(args.batches)
    name, graph = backend.removesuffix("+graph"), backend.endswith("+graph")
    config = EngineConfig(
        model=str(folder),
        load_format="dummy",
        attention_backend=name,
        disable_cuda_graph=not graph,
        cuda_graph_max_bs=max_batch,
        max_total_tokens=(max(max_batch, 32) + 2) * (max(ctx, 1024) + 32),
        max_running_requests=max(max_batch, 32),
        context_length=max(ctx, 1040),
    )
    runner = ModelRunner(config, folder, hf, config.context_length or ctx)
    if runner.graphs is not None:
        print(f"{backend}: each graph's cuBLAS path {runner.graphs.blas}")
        print(f"{backend}: skinny GEMV per (out, in, gated) projection {_gemv_picks(runner)}")
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # a decode step reads only its batch's rows of the input embedding (unless lm_head shares it)
    model: Any = runner.model
    embed = model.embed_tokens.weight
    row_bytes = embed.shape[1] * embed.element_size()
    embed_bytes = 0 if model.tie_word_embeddings else embed.numel() * embed.element_size()
    kv_per_token = runner.pool.bytes_per_slot(
        hf.num_hidden_layers, runner.pool.num_kv_heads, runner.pool.head_dim, runner.dtype
    )
    rows: list[dict[str, Any]] = []
    for n in (1, 32):
        reqs = make_reqs(runner, n, 1024, hf.vocab_size)
        t = timed(runner, Batch(ForwardMode.EXTEND, reqs, [1024] * n), args.reps)
        flops = (weight_bytes - embed_bytes) * 1024 * n  # 2 FLOP per 2-byte weight per token
        rows.append(
            {
                "backend": backend,
                "phase": f"prefill {n}x1024",
                "ms": t * 1e3,
                "TFLOP/s": flops / t / 1e12,
            }
        )
    # the same weights, graphs captured again per step mode (each from the runner's defaults)
    modes: list[str | None] = list(args.modes)
    if runner.graphs is None or not modes:
        modes = [None]
    defaults = _defaults(runner) if runner.graphs is not None else {}
    for mode in modes:
        if mode is not None:
            assert runner.graphs is not None
            apply_mode(runner, parse_mode(mode), defaults, args.prefetch_bs)
            runner.graphs.capture()
            print(f"{backend}: {mode}: {_gemv_picks(runner)}")
        for b in args.batches:
            batch = decode_batch(runner, b, args.context, hf.vocab_size)
            t = timed(runner, batch, args.reps)
            t_pipe = pipelined(runner, batch, max(args.reps, 10))
            step_bytes = weight_bytes - embed_bytes + b * row_bytes
            roof = (step_bytes + b * (args.context + 1) * kv_per_token) / bandwidth
            rows.append(
                {
                    "backend": backend + ("" if mode is None else f" {mode}"),
                    "phase": f"decode B={b} ctx={args.context}",
                    "ms": t * 1e3,
                    "roofline_ms": roof * 1e3,
                    "x_roofline": t / roof,
                    "pipelined_ms": t_pipe * 1e3,
                    "x_roofline_pipelined": t_pipe / roof,
                }
            )
    del runner
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3.1-8b"))
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["triton+graph", "triton", "flashinfer", "torch"],
        help="attention backends; '+graph' replays decode in CUDA graphs",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--output-file", default=None)
    ap.add_argument(
        "--gemv-modes",
        nargs="+",
        choices=["auto", "on", "off"],
        help="decode steps again per WEFT_GEMV mode, graphs captured anew on the same weights",
    )
    ap.add_argument(
        "--rope-modes",
        nargs="+",
        choices=["fused", "separate"],
        help="the same per rotary placement (triton backend): in the decode kernel (fused) or "
        "in a launch of its own before it",
    )
    ap.add_argument(
        "--attn-modes",
        nargs="+",
        choices=["plain", "pdl", "wait"],
        help="the same per launch of the decode attention kernels (triton backend): plain, "
        "as programmatic dependents (pdl, as under WEFT_PDL=all), or waiting as one but letting "
        "the next kernel launch only as it ends (wait)",
    )
    ap.add_argument(
        "--sum-modes",
        nargs="+",
        choices=["here", "launch"],
        help="the same per WEFT_SPLIT_SUM: split-K GEMVs and split-KV decode attention summed "
        "by each tile's last program (here) or by a launch of their own",
    )
    ap.add_argument(
        "--warp-modes",
        nargs="+",
        choices=["auto", "2", "4"],
        help="the same per warps of the decode kernel (triton backend): its own default "
        "(auto) or a fixed count",
    )
    ap.add_argument(
        "--prefetch-modes",
        nargs="+",
        help="the same per L2 prefetch of o_proj's weight by the rotating decode kernel (triton "
        "backend): off, start or end (at its programs' start or after their walk), optionally "
        "with :FRACTION of the weight's bytes (end:0.5), for batches up to --prefetch-bs",
    )
    ap.add_argument("--prefetch-bs", type=int, default=4)
    ap.add_argument(
        "--step-modes",
        nargs="+",
        default=[],
        help="the same per mode KEY=VALUE[,KEY=VALUE...], each from the runner's defaults; "
        + "; ".join(f"{k}: {v[1]}" for k, v in SETTINGS.items()),
    )
    args = ap.parse_args()
    flags = {
        "gemv": args.gemv_modes,
        "rope": args.rope_modes,
        "attn": args.attn_modes,
        "sum": args.sum_modes,
        "warps": args.warp_modes,
        "prefetch": args.prefetch_modes,
    }
    args.modes = [f"{key}={m}" for key, ms in flags.items() for m in ms or []] + args.step_modes
    triton_keys: set[str] = set()
    for mode in args.modes:
        try:
            triton_keys |= {k for k in parse_mode(mode) if SETTINGS[k][2]}
        except ValueError as e:
            ap.error(f"mode {mode!r}: {e}")
    others = [b for b in args.backends if b.removesuffix("+graph") != "triton"]
    if triton_keys and others:
        ap.error(f"modes with {', '.join(sorted(triton_keys))} switch the triton backend; drop "
                 f"{', '.join(others)} from --backends")  # fmt: skip
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows: list[dict[str, Any]] = []
    for backend in args.backends:
        before = len(rows)
        try:
            rows += run_backend(args, backend, bandwidth)
        except Exception as e:  # report and go on with the other backends
            rows.append({"backend": backend, "error": f"{type(e).__name__}: {e}"})
        for row in rows[before:]:
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            )
    if args.output_file:
        Path(args.output_file).write_text(
            json.dumps({"copy_TBps": bandwidth / 1e12, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
