"""Where a decode step's time goes: GPU kernels of one step, and the scheduler's host work per step.

    python benchmarks/profile_step.py runner [--batches 1 64 256]     # kernels by GPU time
    python benchmarks/profile_step.py scheduler [--num-prompts 256]   # host vs model time per step

`runner` builds the ModelRunner (dummy weights of a real config, CUDA graphs unless
--eager) and, per batch size, splits `ModelRunner.forward` into its phases (batch tensors, model,
logits + sampling) with synchronizing timers, then lists the kernels of a few profiled steps by
GPU time. `scheduler` runs the Scheduler's loop in this process (no ZMQ, no detokenizer) on
N x input/output random-token requests and reports, per step, the wall time of scheduling,
launching (host work to queue the step) and processing results (which waits for the device's
tokens: with overlap scheduling those of the step before); then the functions with the most host
time (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_utils import model_folder
from one_batch import decode_batch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.loader import read_hf_config
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.scheduler import Scheduler

REPO = Path(__file__).resolve().parents[1]


def sync_ms(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def time_phases(runner: ModelRunner, batch: Batch, whole: bool = False) -> list[float]:
    """ms of building the batch tensors, of the model (launch: tensors + model), and of logits +
    sampling + reading the tokens (or of the whole step)."""
    if whole:
        return [sync_ms(lambda: runner.forward(batch))[1]]
    runner.req_to_token.flush()
    _, t_prep = sync_ms(lambda: runner._forward_batch(batch))
    step, t_model = sync_ms(lambda: runner.launch(batch))
    _, t_res = sync_ms(lambda: (runner.sample(step), step.resolve()))
    return [t_prep, t_model - t_prep, t_res]


def engine_config(args: argparse.Namespace, folder: Path, **more: Any) -> EngineConfig:
    """Dummy weights of the config, with the backend, graph and kernel options of the command."""
    return EngineConfig(
        model=str(folder),
        load_format="dummy",
        attention_backend=args.backend,
        disable_cuda_graph=args.eager,
        disable_fused_kernels=args.unfused,
        kv_cache_dtype=args.kv_cache_dtype,
        **more,
    )


def profile_runner(args: argparse.Namespace) -> None:
    folder = Path(args.config)
    hf = read_hf_config(folder)
    ctx = args.context + 64  # make_reqs rounds each row up to whole pages
    max_batch = max(args.batches)
    config = engine_config(
        args,
        folder,
        cuda_graph_max_bs=max_batch,
        max_total_tokens=(max_batch + 2) * (ctx + 32),
        max_running_requests=max(max_batch, 32),
        context_length=max(ctx, 1040),
    )
    runner = ModelRunner(config, folder, hf, config.context_length or ctx)
    if args.decode_warps:  # the triton backend's decode kernel at a fixed warp count
        runner.attn.decode_warps = args.decode_warps  # type: ignore[attr-defined]
        if runner.graphs is not None:
            runner.graphs.capture()
    for b in args.batches:
        batch = decode_batch(runner, b, args.context, hf.vocab_size)
        for _ in range(3):
            runner.forward(batch)
        phases: dict[str, list[float]] = {"batch tensors": [], "model": [], "logits+sample": []}
        for _ in range(args.reps):
            for k, v in zip(phases, time_phases(runner, batch), strict=True):
                phases[k].append(v)
        t_all = time_phases(runner, batch, whole=True)[0]
        line = ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in phases.items())
        print(f"\n== decode B={b} ctx={args.context}: {line}; whole forward {t_all:.3f} ms")
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                runner.forward(batch)
            torch.cuda.synchronize()
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70
            )
        )
        kernel_timeline(prof, steps=3)


def kernel_timeline(prof: torch.profiler.profile, steps: int) -> None:
    """Per step: kernels, their summed GPU time, the GPU's idle time between consecutive kernels
    (the launch gaps inside a graph), and what each kernel adds to the step (marginal_time)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])  # fmt: skip
    if gpu:
        print("\n".join(timeline_report(gpu, steps)))


def timeline_report(gpu: list[dict[str, Any]], steps: int, rows: int = 12) -> list[str]:
    """The report's lines for GPU events ({name, ts, dur} in us, sorted by ts) of `steps` steps.

    A kernel's own duration overstates its cost where kernels overlap: a programmatic
    dependent starts (and waits) during the kernel before it. Its marginal time is how far it
    moves the latest end so far, end - max(earlier ends), floored at 0; over a step they add up
    to the step's span less its idle gaps. Per kernel name: marginal us per step, count per step,
    own us per call (median)."""
    busy = sum(e.get("dur", 0) for e in gpu)
    gaps, early = [], 0
    marginal: dict[str, list[tuple[float, float]]] = {}
    end = gpu[0]["ts"]
    for i, e in enumerate(gpu):
        start, dur = e["ts"], e.get("dur", 0)
        if 0 < start - end < 50:  # inside a step (longer: between steps, host work)
            gaps.append((start - end, gpu[i - 1]["name"][:45], e["name"][:45]))
        early += int(start < end)
        name = e["name"][:60]
        marginal.setdefault(name, []).append((max(0.0, start + dur - max(end, start)), dur))
        end = max(end, start + dur)
    idle = sum(g[0] for g in gaps)
    median = statistics.median(g[0] for g in gaps) if gaps else 0.0
    lines = [f"per step: {len(gpu) / steps:.0f} kernels, {busy / steps / 1e3:.3f} ms of kernel "
             f"time, {idle / steps / 1e3:.3f} ms idle in {len(gaps) / steps:.0f} gaps under 50 us "
             f"(median {median:.2f} us); {early / steps:.0f} kernels started before the one "
             f"before ended"]  # fmt: skip
    by_pair: dict[tuple[str, str], list[float]] = {}
    for gap, a, b in gaps:
        by_pair.setdefault((a, b), []).append(gap)
    lines.append("idle between kernel pairs, us per step (pair: count per step x median gap):")
    for (a, b), v in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"  {sum(v) / steps:7.1f}  {a} -> {b}: {len(v) / steps:.0f} x "
                     f"{statistics.median(v):.2f}")  # fmt: skip
    lines.append("marginal time per step by kernel (us per step, calls per step, own us per call):")
    for name, v in sorted(marginal.items(), key=lambda kv: -sum(m for m, _ in kv[1]))[:rows]:
        own = statistics.median(d for _, d in v)
        lines.append(f"  {sum(m for m, _ in v) / steps:8.1f}  {len(v) / steps:4.0f} x {own:6.2f}"
                     f"  {name}")  # fmt: skip
    return lines


def profile_scheduler(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="weft-prof-"))
    folder, note = model_folder(args.config, work)
    print(f"model folder: {folder} ({note})")
    hf = read_hf_config(folder)
    config = engine_config(
        args,
        folder,
        overlap_schedule=args.overlap,
        page_size=args.page_size,
        context_length=args.input_len + args.output_len + 64 + (args.groups and args.prefix_len),
        max_running_requests=args.max_running,
        cuda_graph_max_bs=args.max_running,
        enable_mixed_chunk=args.mixed,
        disable_radix_cache=args.no_radix_cache,
    )
    sched = Scheduler(config, folder, channel=None)
    if args.no_model:
        host_work_only(sched.runner, hf.hidden_size)
    if not args.no_gc_freeze:  # as the scheduler process does (ipc.run_child)
        gc.collect()
        gc.freeze()
    gc_time = GcTime()
    all_ids = prompts(args, hf.vocab_size)
    for i, ids in enumerate(all_ids):
        params = SamplingParams(temperature=0, ignore_eos=True)
        sched.handle(TokenizedGenerateReq(str(i), ids, params, args.output_len))
    steps: list[tuple[str, int, float, float, float]] = []  # mode, batch, ms: sched/launch/results
    prof = cProfile.Profile()
    mode = ForwardMode.EXTEND if args.trace_extend else ForwardMode.DECODE
    trace = KernelTrace(args.trace_steps, int(args.max_running * 0.9), mode, args.trace_skip)
    t_start = time.perf_counter()
    while sched.has_work():
        if args.cprofile:
            prof.enable()
        t0 = time.perf_counter()
        batch = sched.schedule()
        trace.before(batch)
        t1 = time.perf_counter()
        step = sched.launch(batch)
        t2 = time.perf_counter()
        sched.process_results(step)
        t3 = time.perf_counter()
        if args.cprofile:
            prof.disable()
        if batch is not None:
            ms = ((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
            steps.append((batch.mode.name, len(batch.reqs), *ms))
    trace.report(args.rows)
    total = time.perf_counter() - t_start
    gc_time.report()
    gc.unfreeze()  # (else triton's bindings report the frozen objects as leaks at exit)
    out_tokens = len(all_ids) * args.output_len
    print(f"{len(steps)} steps in {total:.2f} s: {out_tokens / total:.0f} output tok/s")
    print("first steps (mode, requests, ms schedule / launch / results):")
    for mode, n, *times in steps[:24]:
        print(f"  {mode} {n}: " + " / ".join(f"{x:.1f}" for x in times))
    for mode in ("EXTEND", "DECODE"):
        rows = [s for s in steps if s[0] == mode]
        if rows:
            print(
                f"{mode}: {len(rows)} steps, mean batch {statistics.mean(s[1] for s in rows):.1f}"
            )
            _print_split(rows)
    big = [s for s in steps if s[0] == "DECODE" and s[1] >= args.max_running * 0.9]
    if big:
        print(f"DECODE at batch >= {int(args.max_running * 0.9)}:")
        _print_split(big)
    if args.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """--num-prompts random prompts of --input-len tokens; with --groups G, G x --group-size
    prompts, each group's sharing a random --prefix-len prefix before its own --input-len."""
    gen = torch.Generator().manual_seed(0)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    if not args.groups:
        return [rand(args.input_len) for _ in range(args.num_prompts)]
    shared = [rand(args.prefix_len) for _ in range(args.groups)]
    return [p + rand(args.input_len) for p in shared for _ in range(args.group_size)]


class KernelTrace:
    """torch.profiler over `steps` consecutive steps of `mode` (decode steps: of at least
    `min_batch` requests; the first ones met after `skip` of them), then a table of their kernels
    by GPU time and the GPU's idle gaps between kernels, each with the host call it ended on."""

    def __init__(
        self, steps: int, min_batch: int, mode: ForwardMode = ForwardMode.DECODE, skip: int = 0
    ) -> None:
        self.left, self.traced, self.skip = steps, 0, skip
        self.mode, self.min_batch = mode, (min_batch if mode == ForwardMode.DECODE else 0)
        self.prof: torch.profiler.profile | None = None

    def before(self, batch: Batch | None) -> None:
        """Called before each step is launched."""
        big = batch is not None and batch.mode == self.mode and len(batch.reqs) >= self.min_batch
        if self.left < 0:  # done
            return
        if self.prof is None and big and self.skip > 0:
            self.skip -= 1
            return
        if self.prof is None:
            if big and self.left > 0:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            else:
                return
        elif self.left == 0 or not big:
            self._stop()
            return
        self.left -= 1
        self.traced += 1

    def _stop(self) -> None:
        if self.left >= 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            assert self.prof is not None
            self.prof.stop()
        self.left = -1  # done

    def report(self, rows: int) -> None:
        if self.prof is None:
            return
        self._stop()
        what = f"{self.mode.name.lower()} steps at batch >= {self.min_batch}"
        print(f"kernels of {self.traced} {what} (with overlap")
        print("scheduling, the first traced step's GPU work may fall partly outside the trace):")
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            print(f"by {key}:")
            table = self.prof.key_averages().table(
                sort_by=key, row_limit=rows, max_name_column_width=70
            )
            print(table)
        self._gaps(rows)

    def _gaps(self, rows: int) -> None:
        """The GPU's idle time between the traced kernels (gaps over 50 us), the largest first,
        each with the host call that launched the kernel after it and the blocking host calls
        (synchronize, alloc, free, memcpy) under way when the GPU went idle."""
        assert self.prof is not None
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self.prof.export_chrome_trace(f.name)
            events = json.loads(Path(f.name).read_text())["traceEvents"]
        gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])  # fmt: skip
        runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
        launches = {e["args"].get("correlation"): e for e in runtime if "correlation" in e["args"]}
        blocking = [e for e in runtime
                    if any(w in e["name"] for w in ("ynchronize", "Alloc", "Free", "Memcpy"))]  # fmt: skip

        def during(t: float) -> str:
            calls = {e["name"] for e in blocking if e["ts"] <= t <= e["ts"] + e.get("dur", 0)}
            return ", ".join(sorted(calls)) or "-"

        gaps = []
        end = gpu[0]["ts"] + gpu[0].get("dur", 0) if gpu else 0.0
        for e in gpu[1:]:
            if e["ts"] - end > 50:
                host = launches.get(e["args"].get("correlation"), {})
                late = host.get("ts", 0) - end
                gaps.append(
                    (e["ts"] - end, e["name"][:40], host.get("name", "?"), late, during(end))
                )
            end = max(end, e["ts"] + e.get("dur", 0))
        span = (end - gpu[0]["ts"]) / 1e3 if gpu else 0.0
        idle = sum(g[0] for g in gaps) / 1e3
        print(f"GPU idle between kernels (gaps > 50 us): {idle:.1f} ms of a {span:.1f} ms span, "
              f"{len(gaps)} gaps; largest (us, next kernel, its launch call, launched us after "
              f"the GPU went idle, [blocking host calls then]):")  # fmt: skip
        for us, name, call, late, host_calls in sorted(gaps, reverse=True)[:rows]:
            print(f"  {us:8.0f}  {name:<40} {call} +{late:.0f}  [{host_calls}]")


def host_work_only(runner: ModelRunner, hidden_size: int) -> None:
    """The model's forward becomes zeros of the right shape and the attention backend prepares
    nothing, so a step's time is the host's work; decode steps plan shared prefixes as the triton
    backend's would (radix cache on). For comparing host code on a machine without a GPU."""

    def zeros(fb: Any, attn: Any) -> torch.Tensor:
        return torch.zeros(fb.input_ids.numel(), hidden_size, dtype=runner.dtype)

    runner.model.forward = zeros
    runner.attn.prepare = lambda fb: None
    runner.plan_shared = not runner.config.disable_radix_cache


class GcTime:
    """Count and wall time of the garbage collector's runs per generation, from now on."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t0

    def report(self) -> None:
        gc.callbacks.remove(self._on_gc)
        parts = (
            f"gen {g}: {n} runs, {s:.3f} s"
            for g, (n, s) in enumerate(zip(self.runs, self.seconds, strict=True))
        )
        print(f"garbage collections ({gc.get_freeze_count()} objects frozen): " + "; ".join(parts))


def _print_split(rows: list[tuple[str, int, float, float, float]]) -> None:
    parts = ("schedule", "launch", "results (waits for the device)")
    cols = [[r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows]]
    meds = [statistics.median(c) for c in cols]
    sums = [sum(c) / 1e3 for c in cols]
    text = "; ".join(
        f"{p} {m:.2f} ms (sum {t:.2f} s)" for p, m, t in zip(parts, meds, sums, strict=True)
    )
    print(f"  medians per step: {text}; step {sum(meds):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["runner", "scheduler"])
    ap.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3.1-8b"))
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--unfused", action="store_true", help="torch ops instead of fused kernels")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--decode-warps", type=int, default=0, help="runner: the decode kernel's warps")
    ap.add_argument("--rows", type=int, default=25, help="rows of the kernel / cProfile tables")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--page-size", type=int, default=None, help="default: the device's")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the scheduler's host work")
    ap.add_argument("--mixed", action="store_true", help="enable_mixed_chunk (mixed prefill steps)")
    ap.add_argument("--groups", type=int, default=0, help="scheduler: G groups sharing a prefix")
    ap.add_argument("--group-size", type=int, default=16, help="scheduler: requests per group")
    ap.add_argument("--prefix-len", type=int, default=2048, help="scheduler: shared tokens")
    ap.add_argument(
        "--trace-steps", type=int, default=0, help="scheduler: steps to trace (decode, or extend)"
    )
    ap.add_argument("--trace-extend", action="store_true", help="scheduler: trace extend steps")
    ap.add_argument("--trace-skip", type=int, default=0, help="scheduler: steps to pass first")
    ap.add_argument(
        "--no-model", action="store_true", help="scheduler: host work only (see host_work_only)"
    )
    ap.add_argument(
        "--no-gc-freeze", action="store_true", help="scheduler: no gc.freeze() after start-up"
    )
    ap.add_argument("--no-radix-cache", action="store_true", help="scheduler: radix cache off")
    args = ap.parse_args()
    if args.decode_warps and args.backend != "triton":
        ap.error(f"--decode-warps sets the triton backend's decode kernel, not {args.backend}'s")
    if args.what == "runner":
        profile_runner(args)
    else:
        profile_scheduler(args)


if __name__ == "__main__":
    main()
