"""The profile and scheduler subcommands of benchmarks/step.py (a decode step's kernels by GPU
time; the scheduler's host work against the model's time per step), and the one-batch requests
that every step.py subcommand runs.

`profile` builds the ModelRunner (CUDA graphs unless --eager) and, per batch size, splits
`ModelRunner.forward` into its phases (batch tensors, model, logits + sampling) with synchronizing
timers, then lists the kernels of a few profiled steps by GPU time, the idle gaps between them and
what each kernel adds to the step. `scheduler` runs the Scheduler's loop in this process (no ZMQ,
no detokenizer) on N x input/output random-token requests and reports, per step, the wall time of
scheduling, launching (host work to queue the step) and processing results (which waits for the
device's tokens: with overlap scheduling those of the step before); --trace-steps adds the kernels
of some steps, --cprofile the functions with the most host time.
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
from bench_utils import merge_kwargs, model_folder
from offline_lora import random_adapters, spread_adapters

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import Batch, ForwardMode
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.loader import read_hf_config
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.scheduler import Scheduler

Step = tuple[str, int, float, float, float]  # mode, requests, ms: schedule / launch / results


def add_profile_args(sub: Any, common: argparse.ArgumentParser) -> None:
    """The profile and scheduler subparsers of step.py."""
    shared = argparse.ArgumentParser(add_help=False, parents=[common])
    shared.add_argument(
        "--backend", default="auto", help="attention backend (auto: triton on CUDA)"
    )
    shared.add_argument("--eager", action="store_true", help="no CUDA graphs")
    shared.add_argument("--rows", type=int, default=25, help="rows of the kernel/cProfile tables")
    prof = sub.add_parser("profile", parents=[shared], help="a decode step's kernels by GPU time")
    prof.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    prof.add_argument("--context", type=int, default=2048)
    prof.add_argument("--reps", type=int, default=10)
    sched = sub.add_parser("scheduler", parents=[shared], help="host vs model time per step")
    sched.add_argument("--num-prompts", type=int, default=256)
    sched.add_argument("--input-len", type=int, default=1000)
    sched.add_argument("--output-len", type=int, default=200)
    sched.add_argument("--max-running", type=int, default=256)
    sched.add_argument("--groups", type=int, default=0, help="G groups sharing a prefix")
    sched.add_argument("--group-size", type=int, default=16, help="requests per group")
    sched.add_argument("--prefix-len", type=int, default=2048, help="tokens each group shares")
    sched.add_argument("--trace-steps", type=int, default=0, help="steps to trace")
    sched.add_argument("--trace", choices=["decode", "extend"], default="decode")
    sched.add_argument("--cprofile", action="store_true", help="cProfile the host work")


##### One batch #####


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


def run_profile(args: argparse.Namespace) -> None:
    (profile_runner if args.what == "profile" else profile_scheduler)(args)


def engine_config(args: argparse.Namespace, folder: Path, **more: Any) -> EngineConfig:
    base = {"model": str(folder), "load_format": "dummy", "attention_backend": args.backend,
            "disable_cuda_graph": args.eager, **more}  # fmt: skip
    return EngineConfig.from_kwargs(**merge_kwargs(base, args.engine_arg))


##### profile #####


def sync_ms(fn: Any) -> tuple[Any, float]:
    """fn's result and its ms, the device idle before and after (on CPU: the host's clock)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def activities() -> tuple[list[Any], str]:
    """The profiler's activities here, and the column to sort its table by."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        return [*acts, torch.profiler.ProfilerActivity.CUDA], "self_cuda_time_total"
    return acts, "self_cpu_time_total"


def time_phases(runner: ModelRunner, batch: Batch) -> list[float]:
    """ms of building the batch tensors, of the model, and of logits + sampling + the tokens."""
    runner.req_to_token.flush()
    _, t_prep = sync_ms(lambda: runner._forward_batch(batch))
    step, t_model = sync_ms(lambda: runner.launch(batch))
    _, t_res = sync_ms(lambda: (runner.sample(step), step.resolve()))
    return [t_prep, t_model - t_prep, t_res]


def profile_runner(args: argparse.Namespace) -> None:
    hf = read_hf_config(args.config)
    ctx, max_batch = args.context + 64, max(args.batches)
    config = engine_config(args, args.config, cuda_graph_max_bs=max_batch,
                           max_total_tokens=(max_batch + 2) * ctx,
                           max_running_requests=max(max_batch, 32), context_length=ctx)  # fmt: skip
    runner = ModelRunner(config, args.config, hf, ctx)
    adapters = random_adapters(runner)  # (--engine-arg enable_lora=true: every slot, mixed)
    for b in args.batches:
        batch = spread_adapters(decode_batch(runner, b, args.context, hf.vocab_size), adapters)
        for _ in range(3):
            runner.forward(batch)
        phases: dict[str, list[float]] = {"batch tensors": [], "model": [], "logits+sample": []}
        for _ in range(args.reps):
            for k, v in zip(phases, time_phases(runner, batch), strict=True):
                phases[k].append(v)
        _, t_all = sync_ms(lambda batch=batch: runner.forward(batch))
        line = ", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in phases.items())
        print(f"\n== decode B={b} ctx={args.context}: {line}; whole forward {t_all:.3f} ms")
        acts, sort_by = activities()
        with torch.profiler.profile(activities=acts) as prof:
            sync_ms(lambda batch=batch: [runner.forward(batch) for _ in range(3)])
        print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows,
                                        max_name_column_width=70))  # fmt: skip
        gpu = gpu_events(prof)
        if gpu:
            print("\n".join(timeline_report(gpu, steps=3)))


def gpu_events(prof: torch.profiler.profile) -> list[dict[str, Any]]:
    """The trace's kernels, copies and memsets ({name, ts, dur, args} in us), sorted by start."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in events if e.get("cat") in kinds), key=lambda e: e["ts"])


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
    for (a, b), pair in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"  {sum(pair) / steps:7.1f}  {a} -> {b}: {len(pair) / steps:.0f} x "
                     f"{statistics.median(pair):.2f}")  # fmt: skip
    lines.append("marginal time per step by kernel (us per step, calls per step, own us per call):")
    for name, v in sorted(marginal.items(), key=lambda kv: -sum(m for m, _ in kv[1]))[:rows]:
        own = statistics.median(d for _, d in v)
        lines.append(f"  {sum(m for m, _ in v) / steps:8.1f}  {len(v) / steps:4.0f} x {own:6.2f}"
                     f"  {name}")  # fmt: skip
    return lines


##### scheduler #####


def profile_scheduler(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="weft-prof-"))
    folder, note = model_folder(str(args.config), work)
    print(f"model folder: {folder} ({note})")
    hf = read_hf_config(folder)
    ctx = args.input_len + args.output_len + 64 + (args.groups and args.prefix_len)
    config = engine_config(args, folder, context_length=ctx,
                           max_running_requests=args.max_running,
                           cuda_graph_max_bs=args.max_running)  # fmt: skip
    sched = Scheduler(config, folder, channel=None)
    gc.collect()
    gc.freeze()  # as the scheduler process does (ipc.run_child)
    all_ids = prompts(args, hf.vocab_size)
    for i, ids in enumerate(all_ids):
        params = SamplingParams(temperature=0, ignore_eos=True)
        sched.add_request(TokenizedGenerateReq(str(i), ids, params, args.output_len))
    steps: list[Step] = []
    prof = cProfile.Profile()
    mode = ForwardMode.EXTEND if args.trace == "extend" else ForwardMode.DECODE
    trace = KernelTrace(args.trace_steps, int(args.max_running * 0.9), mode)
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
            steps.append((batch.mode.name, len(batch.reqs), *((t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                                              (t3 - t2) * 1e3)))  # fmt: skip
    trace.report(args.rows)
    total = time.perf_counter() - t_start
    gc.unfreeze()  # (else triton's bindings report the frozen objects as leaks at exit)
    out_tokens = len(all_ids) * args.output_len
    print(f"{len(steps)} steps in {total:.2f} s: {out_tokens / total:.0f} output tok/s")
    print("first steps (mode, requests, ms schedule / launch / results):")
    for name, n, *times in steps[:24]:
        print(f"  {name} {n}: " + " / ".join(f"{x:.1f}" for x in times))
    for name in ("EXTEND", "DECODE"):
        rows = [s for s in steps if s[0] == name]
        if rows:
            print(
                f"{name}: {len(rows)} steps, mean batch {statistics.mean(s[1] for s in rows):.1f}"
            )
            print(split_line(rows))
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


def split_line(rows: list[Step]) -> str:
    """'  medians per step: schedule ... ms (sum ... s); ...; step ... ms'."""
    parts = ("schedule", "launch", "results (waits for the device)")
    cols = [[r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows]]
    meds = [statistics.median(c) for c in cols]
    sums = [sum(c) / 1e3 for c in cols]
    text = "; ".join(
        f"{p} {m:.2f} ms (sum {t:.2f} s)" for p, m, t in zip(parts, meds, sums, strict=True)
    )
    return f"  medians per step: {text}; step {sum(meds):.2f} ms"


class KernelTrace:
    """torch.profiler over `steps` consecutive steps of `mode` (decode steps: of at least
    `min_batch` requests), then a table of their kernels by GPU and by host time."""

    def __init__(self, steps: int, min_batch: int, mode: ForwardMode) -> None:
        self.left, self.traced, self.mode = steps, 0, mode
        self.min_batch = min_batch if mode == ForwardMode.DECODE else 0
        self.prof: torch.profiler.profile | None = None

    def before(self, batch: Batch | None) -> None:
        """Called before each step is launched."""
        big = batch is not None and batch.mode == self.mode and len(batch.reqs) >= self.min_batch
        if self.left < 0:  # done
            return
        if self.prof is None:
            if not (big and self.left > 0):
                return
            self.prof = torch.profiler.profile(activities=activities()[0])
            self.prof.start()
        elif self.left == 0 or not big:
            self._stop()
            return
        self.left -= 1
        self.traced += 1

    def _stop(self) -> None:
        if self.left >= 0 and self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.stop()
        self.left = -1

    def report(self, rows: int) -> None:
        if self.prof is None:
            return
        self._stop()
        print(f"kernels of {self.traced} {self.mode.name.lower()} steps at batch >= "
              f"{self.min_batch} (with overlap scheduling, the first traced step's GPU work may "
              f"fall partly outside the trace):")  # fmt: skip
        for key in dict.fromkeys((activities()[1], "self_cpu_time_total")):
            print(f"by {key}:")
            print(self.prof.key_averages().table(sort_by=key, row_limit=rows,
                                                 max_name_column_width=70))  # fmt: skip
