"""A decode step's kernels from the inside: each program's stamps (kernels/timeline.py) in the
last step of a pipelined run, in CUDA graphs, triton backend, Llama-3.1-8B with dummy weights.

    python benchmarks/step_timeline.py [--batches 1 8] [--context 2048] [--layers 3]

Per launch of the skinny GEMV, RMSNorm and decode split kernels (at batches of 1-16 with the
defaults, all of a decode graph's kernels but the embedding; the decode reduce, rotary and
shared-prefix kernels and cuBLAS, where they run, write no stamps and show in the next
launch's release) the report gives, relative to the previous launch's last program end:
- `release`: when its first program passed its wait (a programmatic dependent) or started (a
  plain launch), i.e. what the kernel boundary costs;
- `work`: the median program's time from its wait to its main work done (the K walk, the
  attention walk, the row loaded), and `tail`: from the last program's work done to the last
  end (stores, split sums and merges);
- the spread of program starts and releases (how the grid ramps), and how its programs fell
  on the SMs: how many SMs ran one, and the most on one SM (a programmatic dependent that
  launches early lands where the kernel before it leaves room).
Then the same per kernel kind, summed over a step, against the step's span: how much of it is
boundaries, how much is inside kernels. With --cupti, a torch profiler trace of pipelined steps
adds what the GPU runs outside the graph (lm_head, sampling, input copies) and where it idles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from one_batch import _defaults, apply_mode, decode_batch, parse_mode, pipelined
from profile_step import timeline_report

from weft.kernels import timeline
from weft.runtime.config import EngineConfig
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.loader import read_hf_config

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Launch:
    """One launch's programs, summarised (ns on the GPU's global timer)."""

    name: str
    programs: int
    first_start: int
    last_start: int
    first_release: int
    last_release: int
    work: float  # median program's release -> work done
    last_work: int  # the latest work-done stamp
    last_end: int
    sms: int  # SMs that ran a program
    most_per_sm: int


def summarise(records: list[tuple[Any, list[list[int]]]]) -> list[Launch]:
    """Launches whose programs all wrote their stamps (the replayed graph's), in launch order."""
    out = []
    for region, stamps in records:
        if not stamps or any(s[0] == 0 or s[3] == 0 for s in stamps):
            continue
        per_sm: dict[int, int] = {}
        for s in stamps:
            per_sm[s[4]] = per_sm.get(s[4], 0) + 1
        out.append(Launch(
            region.name, len(stamps), min(s[0] for s in stamps), max(s[0] for s in stamps),
            min(s[1] for s in stamps), max(s[1] for s in stamps),
            statistics.median(s[2] - s[1] for s in stamps), max(s[2] for s in stamps),
            max(s[3] for s in stamps), len(per_sm), max(per_sm.values()),
        ))  # fmt: skip
    return sorted(out, key=lambda r: r.first_start)


def kind(name: str, shapes: dict[str, str]) -> str:
    return shapes.get(name, name)


def report(launches: list[Launch], shapes: dict[str, str], show: int) -> list[str]:
    """The report's lines: the first `show` launches one by one, then each kind per step."""
    if not launches:
        return ["no launch wrote its stamps (was the timeline active during capture?)"]
    t0 = launches[0].first_start
    stamps = sorted({x for r in launches for x in (r.first_start, r.first_release, r.last_end)})
    tick = min((b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a), default=0)
    span = (max(r.last_end for r in launches) - t0) / 1e3
    lines = [f"{len(launches)} launches over {span:.1f} us (finest step between stamps "
             f"{tick} ns)", "  us from the step's first start: kernel, programs (SMs, most on "
             "one): start spread, release (after the previous end), work (median), tail, "
             "end"]  # fmt: skip
    per_kind: dict[str, list[float]] = {}
    prev_end = t0
    for i, r in enumerate(launches):
        release = (r.first_release - prev_end) / 1e3
        inside = (r.last_end - max(r.first_release, prev_end)) / 1e3
        acc = per_kind.setdefault(kind(r.name, shapes), [0.0, 0.0, 0])
        acc[0] += release
        acc[1] += inside
        acc[2] += 1
        if i < show:
            lines.append(
                f"  {(r.first_start - t0) / 1e3:8.2f} {kind(r.name, shapes):14} {r.programs:4} "
                f"({r.sms:3}, {r.most_per_sm}): "
                f"starts +{(r.last_start - r.first_start) / 1e3:5.2f}, release {release:6.2f} "
                f"(last +{(r.last_release - r.first_release) / 1e3:5.2f}), work {r.work / 1e3:6.2f}"
                f", tail {(r.last_end - r.last_work) / 1e3:5.2f}, end {(r.last_end - t0) / 1e3:8.2f}"
            )
        prev_end = max(prev_end, r.last_end)
    lines.append("per kind over the step: us releasing (boundaries), us inside (first release to "
                 "last end), launches")  # fmt: skip
    for name, (rel, ins, n) in sorted(per_kind.items(), key=lambda kv: -kv[1][0] - kv[1][1]):
        lines.append(f"  {name:14} {rel:8.1f} {ins:9.1f} {n:5}")
    total_rel = sum(v[0] for v in per_kind.values())
    lines.append(f"  boundaries {total_rel:.1f} us + inside {span - total_rel:.1f} us = {span:.1f}")
    return lines


def gpu_events(runner: ModelRunner, batch: Any, steps: int) -> list[dict[str, Any]]:
    """The GPU's kernels and copies over `steps` pipelined steps, torch profiler (CUPTI)."""
    pipelined(runner, batch, steps)  # warm
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        pipelined(runner, batch, steps)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])  # fmt: skip


def span_report(gpu: list[dict[str, Any]], steps: int) -> str:
    """Per step: the span of the GPU's work, its busy time (union) and idle gaps of 50 us+."""
    end, busy, long_idle = gpu[0]["ts"], 0.0, 0.0
    for e in gpu:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        gap = start - end
        long_idle += gap if gap >= 50 else 0.0
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - gpu[0]["ts"]
    return (
        f"per step (of {steps}, pipelined, profiled): span {span / steps:.1f} us, busy "
        f"{busy / steps:.1f} us, idle in gaps of 50 us+ {long_idle / steps:.1f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3.1-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=3, help="layers shown launch by launch")
    ap.add_argument("--reps", type=int, default=20, help="pipelined steps before the one read")
    ap.add_argument("--cupti", type=int, default=0, metavar="STEPS",
                    help="also trace STEPS pipelined steps with the torch profiler")  # fmt: skip
    ap.add_argument("--step-modes", nargs="+", default=[],
                    help="graphs captured again per one_batch.py step mode (KEY=VALUE,...)")  # fmt: skip
    ap.add_argument("--prefetch-bs", type=int, default=4, help="as one_batch.py's")
    args = ap.parse_args()
    for mode in args.step_modes:
        try:
            parse_mode(mode)
        except ValueError as e:
            ap.error(f"mode {mode!r}: {e}")
    folder = Path(args.config)
    hf = read_hf_config(folder)
    ctx = args.context + 16
    config = EngineConfig(
        model=str(folder), load_format="dummy", attention_backend="triton",
        cuda_graph_max_bs=max(args.batches), max_running_requests=max(max(args.batches), 32),
        max_total_tokens=(max(args.batches) + 2) * (ctx + 32), context_length=max(ctx, 1040),
    )  # fmt: skip
    runner = ModelRunner(config, folder, hf, config.context_length or ctx)
    assert runner.graphs is not None, "the timeline reads CUDA graph replays"
    defaults = _defaults(runner)
    for mode in args.step_modes or [None]:
        if mode is not None:
            apply_mode(runner, parse_mode(mode), defaults, args.prefetch_bs)
        trace = timeline.Timeline(runner.device, capacity=1 << 24)
        timeline.activate(trace)
        try:
            runner.graphs.capture()  # again, each launch of the graphs with its stamp slots
        finally:
            timeline.activate(None)
        for b in args.batches:
            run_batch(runner, trace, b, args, hf.vocab_size, mode or "the defaults")


def run_batch(runner: ModelRunner, trace: timeline.Timeline, b: int, args: argparse.Namespace,
              vocab: int, mode: str) -> None:  # fmt: skip
    shapes = {"gemv 6144x4096": "qkv", "gemv 4096x4096": "o_proj", "gemv 28672x4096": "gate_up",
              "gemv 4096x14336": "down"}  # fmt: skip
    batch = decode_batch(runner, b, args.context, vocab)
    trace.buf.zero_()
    ms = pipelined(runner, batch, args.reps) * 1e3
    torch.cuda.synchronize()
    launches = summarise(trace.read())
    print(f"\n== {mode}: decode B={b} ctx={args.context}: {ms:.3f} ms a step pipelined "
          f"(stamps of its last step)")  # fmt: skip
    print("\n".join(report(launches, shapes, 1 + 7 * args.layers)))
    if args.cupti:
        gpu = gpu_events(runner, batch, args.cupti)
        print(span_report(gpu, args.cupti))
        print("\n".join(timeline_report(gpu, args.cupti, rows=25)))


if __name__ == "__main__":
    main()
