"""Speculative decoding at real shapes with a real acceptance (issue 41): `record` runs a real model
pair (the Qwen2.5-Coder GGUFs, on CPU: the files cannot travel to the device) and keeps each
request's prompt ids and, per verify step, its draft and accepted lengths; `replay` runs the same
requests on dummy weights of the same configs (the GPU) with the recorded lengths imposed, so that
every kernel and the scheduler run as they would on the real pair.

    python benchmarks/spec_replay.py record \
        --model ~/.cache/weft-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --variant ngram:speculative_algorithm=ngram \
        --variant "draft:speculative_algorithm=draft,speculative_draft_model_path=$HOME/.cache/weft-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
        --num-prompts 4 --max-new-tokens 128 --trace benchmarks/traces/qwen2.5-coder.json
    python benchmarks/spec_replay.py replay --trace benchmarks/traces/qwen2.5-coder.json \
        --model benchmarks/configs/qwen2.5-coder-1.5b \
        --draft-model benchmarks/configs/qwen2.5-coder-0.5b --batches 1 8 32

Both modes run the plain engine first (the baseline), then each speculative variant, greedy, one
in-process scheduler at a time (`record` verifies drafts at every step, so that the trace has the
text's acceptance throughout; `replay` lets the speculation policy, StepCosts, decide as it does
in serving), driven as its process loop drives it (no tokenizer or HTTP
processes, the same for every variant). Requests run in waves of the batch size, all added at
once; tokens/s is output tokens over the waves' wall time. `record` also checks that each
variant's greedy output equals the baseline's. In `replay` every request generates exactly its
recorded output length (ignore_eos), the n-gram drafter proposes the recorded number of drafts,
and a verify step at output position p accepts as many as the request's recorded step at the
greatest position <= p did (the same step when every step verifies, as in `record`; the policy
may run plain steps between); request j of a wave replays recorded request j mod n.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from bench_utils import device_name, git_commit, markdown_table, merge_kwargs, parse_kv
from spec import SHAREGPT, is_speculative, parse_variant
from spec_workloads import WorkloadSpec, build_workload
from step_profile import activities

import weft.runtime.scheduler.scheduler as scheduler_module
import weft.runtime.scheduler.spec_costs as spec_costs_module
import weft.runtime.scheduler.speculative as speculative_module
from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import Inbox
from weft.runtime.executor.step import LaunchedStep
from weft.runtime.ipc.messages import TokenizedGenerateReq
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.ngram import NgramDrafter
from weft.runtime.scheduler.request import Req
from weft.runtime.scheduler.scheduler import Scheduler
from weft.runtime.server.launch import prepare

REPLAYABLE = ("code-edit", "sharegpt")  # (constrained drafts depend on the text: not replayable)


Step = tuple[int, int, int]  # a verify step: (output tokens before it, drafted, accepted)


@dataclass
class TraceReq:
    """One recorded request: its prompt, output length and verify steps, by variant."""

    workload: str
    input_ids: list[int]
    output_len: int
    steps: dict[str, list[Step]] = field(default_factory=dict)


@dataclass
class Row:
    workload: str
    batch: int
    variant: str
    requests: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    same_as_baseline: int | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


##### Driving a scheduler in this process #####


class Hooks:
    """What `record` reads and `replay` imposes, on the scheduler's step results. A replayed
    verify step at output position p takes the recorded step at the greatest position <= p (the
    same one where every step verifies, as when recorded)."""

    def __init__(self, replay: dict[str, list[Step]] | None = None) -> None:
        self.replay = replay  # rid -> its recorded steps, by position
        self.seen: dict[str, list[Step]] = {}  # rid -> its steps in this run

    def recorded(self, req: Req) -> Step | None:
        assert self.replay is not None
        steps = self.replay.get(req.rid, [])
        i = bisect.bisect_right([p for p, _, _ in steps], len(req.output_ids)) - 1
        return steps[i] if i >= 0 else None

    def results(self, step: LaunchedStep) -> None:
        """Before the scheduler processes `step`: note (record) or impose (replay) each
        request's accepted drafts."""
        if step.batch.drafts is None:
            return
        for req, res, drafts in zip(step.batch.reqs, step.resolve(), step.batch.drafts,
                                    strict=True):  # fmt: skip
            if res.spec_ids is None:
                continue
            if self.replay is not None:
                rec = self.recorded(req)
                a = min(rec[2], len(drafts)) if rec is not None else 0
                res.spec_ids = list(drafts[:a]) + [res.spec_ids[-1]]
                res.next_id, res.spec_accepted = res.spec_ids[0], a
            pos = len(req.output_ids)
            self.seen.setdefault(req.rid, []).append((pos, len(drafts), res.spec_accepted))

    def drafts_wanted(self, req: Req) -> int | None:
        """Replay: the drafts the request's next verify step had when recorded."""
        if self.replay is None:
            return None
        rec = self.recorded(req)
        return rec[1] if rec is not None else 0


@contextmanager
def hooked(hooks: Hooks) -> Iterator[None]:
    """The scheduler's result processing and the n-gram drafter wrapped with `hooks`, inside."""
    original, drafter = scheduler_module.apply_results, speculative_module.NgramDrafter

    def apply_results(step: LaunchedStep, *args: Any) -> Any:
        hooks.results(step)
        return original(step, *args)

    class ReplayDrafter(NgramDrafter):
        req: Req | None = None

        def sync(self, req: Req) -> None:
            self.req = req
            super().sync(req)

        def propose(self, k: int) -> list[int]:
            assert self.req is not None
            want = hooks.drafts_wanted(self.req)
            if want is None:
                return super().propose(k)
            last = (self.req.output_ids or self.req.input_ids)[-1]
            return [last] * min(want, k)  # (what they are does not matter: acceptance is imposed)

    scheduler_module.apply_results = apply_results  # type: ignore[assignment]
    speculative_module.NgramDrafter = ReplayDrafter  # type: ignore[misc]
    try:
        yield
    finally:
        scheduler_module.apply_results = original
        speculative_module.NgramDrafter = drafter  # type: ignore[misc]


def drive(sched: Scheduler, reqs: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Any]:
    """Add `reqs` at once and run the scheduler's loop until all finished: rid -> its Req."""
    done: dict[str, Any] = {}

    def emit(rs: list[Req]) -> None:
        done.update((r.rid, r) for r in rs if r.finished)

    sched.emit = emit  # type: ignore[method-assign]
    for rid, ids, params in reqs:
        sched.add_request(TokenizedGenerateReq(rid, ids, params, params.max_new_tokens or 0))
    while sched.has_work():
        sched.apply(Inbox([], [], []))
        sched.process_results(sched.launch(sched.schedule()))
    sched.settle()
    sched.clock.idle()  # (as the process loop does with nothing to do: no step spans the gap)
    if sched.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return done


def run_variant(
    model: str, name: str, kwargs: dict[str, Any], work: dict[str, list[TraceReq]],
    batches: list[int], replay: bool, profile: bool = False,
) -> tuple[list[Row], dict[str, list[int]], dict[str, list[Step]]]:  # fmt: skip
    """Every workload at every batch size on one in-process engine of `kwargs`: the rows, each
    request's output ids and its verify steps (rid '{workload}/{batch}/{j}')."""
    hooks = Hooks({} if replay and is_speculative(kwargs) else None)
    with hooked(hooks):
        rows, outputs = _run(model, name, kwargs, work, batches, replay, hooks, profile)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, outputs, hooks.seen


def _run(
    model: str, name: str, kwargs: dict[str, Any], work: dict[str, list[TraceReq]],
    batches: list[int], replay: bool, hooks: Hooks, profile: bool = False,
) -> tuple[list[Row], dict[str, list[int]]]:  # fmt: skip
    config = EngineConfig(model=model, **kwargs)
    sched = Scheduler(config, prepare(config).model_path, None)
    if not replay and sched.speculator is not None:  # every step verifies: the whole trace
        sched.speculator.costs.speculate = lambda batch_size: True  # type: ignore[method-assign]
    rows, outputs = [], {}
    for wname, trace in work.items():
        for b in batches:
            n = max(b, len(trace))
            reqs = []
            for j in range(n):
                t, rid = trace[j % len(trace)], f"{wname}/{b}/{j}"
                params = SamplingParams(temperature=0, max_new_tokens=t.output_len,
                                        ignore_eos=replay)  # fmt: skip
                reqs.append((rid, t.input_ids, params))
                if hooks.replay is not None:
                    hooks.replay[rid] = t.steps.get(name, [])
            warm = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
            drive(sched, [(f"warm-{rid}", ids, warm) for rid, ids, _ in reqs[:b]])
            sched.flush_cache()
            row = Row(wname, b, name, requests=n)
            before = dict(sched.clock.counts)
            for i in range(0, n, b):
                t0 = time.perf_counter()
                with profiled(profile and i == 0, f"{name} {wname} bs{b}, first wave"):
                    done = drive(sched, reqs[i : i + b])
                row.wall_s += time.perf_counter() - t0
                for rid, _, _ in reqs[i : i + b]:
                    why = done[rid].finish
                    if why.type == "abort":
                        raise RuntimeError(f"{name}: request {rid} aborted: {why.message}")
                    outputs[rid] = list(done[rid].output_ids)
            for rid, _, _ in reqs:
                row.output_tokens += len(outputs[rid])
                steps = hooks.seen.get(rid, [])
                row.verify_steps += len(steps)
                row.drafted += sum(d for _, d, _ in steps)
                row.accepted += sum(a for _, _, a in steps)
            rows.append(row)
            print(f"  {name} {wname} bs{b}: {row.tok_s:.2f} tok/s, {row.verify_steps} verify "
                  f"steps, {row.accepted}/{row.drafted} drafts accepted; "
                  f"{steps_seen(before, sched.clock.counts)}{costs_seen(sched, b)}",
                  flush=True)  # fmt: skip
    return rows, outputs


@contextmanager
def profiled(on: bool, title: str) -> Iterator[None]:
    """torch.profiler around the block when `on`: its ops by self time on the device (on CPU,
    the host), and on CUDA its host ops too."""
    if not on:
        yield
        return
    acts, sort_by = activities()
    with torch.profiler.profile(activities=acts) as prof:
        yield
    for key in dict.fromkeys((sort_by, "self_cpu_time_total")):
        print(f"\nprofile: {title}, by {key}\n"
              + prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))  # fmt: skip


def steps_seen(before: dict[str, int], after: dict[str, int]) -> str:
    """The waves' steps per kind and their mean launch-to-launch time (StepClock's counts)."""
    cells = []
    for kind in ("extend", "decode", "verify"):
        steps = after[f"{kind}_steps"] - before[f"{kind}_steps"]
        if steps:
            us = after[f"{kind}_us"] - before[f"{kind}_us"]
            cells.append(f"{steps} {kind} x {us / steps / 1e3:.1f} ms")
    return "steps: " + ", ".join(cells)


def costs_seen(sched: Scheduler, batch: int) -> str:
    """What the speculation policy (StepCosts) last knew of `batch`'s size class: its recent
    plain and verify step times and tokens per request per verify step."""
    if sched.speculator is None:
        return ""
    c = sched.speculator.costs.classes.get(spec_costs_module.size_class(batch))
    if c is None:
        return ""
    ms = [", ".join(f"{s * 1e3:.1f}" for s in samples) for samples in (c.decode, c.verify)]
    return (
        f"; StepCosts: plain [{ms[0]}] ms, verify [{ms[1]}] ms, "
        f"{c.tokens_per_req or 0:.2f} tokens per verify"
    )


##### Modes #####


def record(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    """The real model: plain, then each variant, at batch size 1; the trace."""
    tok = prepare(EngineConfig(model=args.model, **args.engine_arg)).tokenizer
    spec = WorkloadSpec(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                        snippet_lines=tuple(args.snippet_lines), sharegpt=args.sharegpt,
                        seed=args.seed)  # fmt: skip
    work: dict[str, list[TraceReq]] = {}
    for wname in args.workloads or REPLAYABLE:
        prompts = build_workload(wname, tok, spec).prompts
        work[wname] = [TraceReq(wname, list(tok.encode(p)), args.max_new_tokens) for p in prompts]
    rows, base = run_variant(args.model, "plain", args.engine_arg, work, [1], False)[:2]
    for wname, trace in work.items():  # the replay generates what plain decoding did
        for j, t in enumerate(trace):
            t.output_len = len(base[f"{wname}/1/{j}"])
    variants = {}
    for name, kw in args.variants:
        got, outs, seen = run_variant(args.model, name, merge_kwargs(args.engine_arg, kw), work,
                                      [1], False)  # fmt: skip
        variants[name] = kw
        for row in got:
            row.same_as_baseline = sum(outs[rid] == base[rid] for rid in outs
                                       if rid.startswith(f"{row.workload}/"))  # fmt: skip
        rows += got
        for wname, trace in work.items():
            for j, t in enumerate(trace):
                t.steps[name] = seen.get(f"{wname}/1/{j}", [])
    trace_doc = {"model": str(args.model), "variants": variants,
                 "requests": [t.__dict__ for ts in work.values() for t in ts]}  # fmt: skip
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    args.trace.write_text(json.dumps(trace_doc))
    return rows, trace_doc


def replay(args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    """Dummy weights of the configs: plain, then each recorded variant, the lengths imposed."""
    doc = json.loads(args.trace.read_text())
    work: dict[str, list[TraceReq]] = {}
    for r in doc["requests"]:
        steps = {k: [(s[0], s[1], s[2]) for s in v] for k, v in r["steps"].items()}
        work.setdefault(r["workload"], []).append(TraceReq(r["workload"], r["input_ids"],
                                                           r["output_len"], steps))  # fmt: skip
    if args.workloads:
        missing = sorted(set(args.workloads) - set(work))
        if missing:
            raise SystemExit(f"{args.trace} has no {', '.join(missing)} requests; it has "
                             f"{', '.join(sorted(work))}")  # fmt: skip
        work = {w: work[w] for w in args.workloads}
    base = merge_kwargs({"load_format": "dummy", "skip_tokenizer_init": True}, args.engine_arg)
    rows = run_variant(args.model, "plain", base, work, args.batches, True, args.profile)[0]
    for name, kw in doc["variants"].items():
        kw = dict(kw)
        if "speculative_draft_model_path" in kw:
            if args.draft_model is None:
                raise SystemExit(f"variant {name} runs a draft model: pass --draft-model CONFIG")
            kw["speculative_draft_model_path"] = args.draft_model
        rows += run_variant(args.model, name, merge_kwargs(base, kw), work, args.batches, True,
                            args.profile)[0]  # fmt: skip
    return rows, doc


##### Report #####


def table(rows: list[Row]) -> str:
    base = {(r.workload, r.batch): r.tok_s for r in rows if r.variant == "plain"}
    head = ["workload", "bs", "variant", "tok/s", "speedup", "acceptance", "accept length",
            "greedy = plain"]  # fmt: skip
    out = []
    for r in rows:
        plain = base.get((r.workload, r.batch))
        acc = r.accepted / r.drafted if r.drafted else None
        length = (r.accepted + r.verify_steps) / r.verify_steps if r.verify_steps else None
        same = "" if r.same_as_baseline is None else f"{r.same_as_baseline}/{r.requests}"
        out.append([r.workload, str(r.batch), r.variant, r.tok_s,
                    r.tok_s / plain if plain else None, acc, length, same])  # fmt: skip
    return markdown_table(head, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("mode", choices=["record", "replay"])
    ap.add_argument("--model", required=True, help="record: the real model (HF folder or "
                    ".gguf); replay: its config folder (dummy weights)")  # fmt: skip
    ap.add_argument("--trace", type=Path, required=True, help="record writes it, replay reads it")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="record: a speculative engine (EngineConfig fields)")  # fmt: skip
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--draft-model", help="replay: the draft model's config folder")
    ap.add_argument("--workloads", nargs="+", choices=REPLAYABLE,
                    help="record: all by default; replay: the trace's, by default")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1], help="replay's batch sizes")
    ap.add_argument("--snippet-lines", type=int, nargs=2, default=[20, 60], metavar=("LO", "HI"),
                    help="code-edit: lines of a snippet (default: 20 60)")  # fmt: skip
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="a JSON of the rows, with the command")
    ap.add_argument("--profile", action="store_true",
                    help="replay: torch.profiler tables of each variant's first wave")  # fmt: skip
    args = ap.parse_args(argv)
    args.engine_arg = parse_kv(args.engine_arg)
    try:
        variants = [parse_variant(text) for text in args.variant]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    for name, kw in variants:
        if name == "plain" or not is_speculative(kw):
            ap.error(f"variant {name}: not 'plain' (the baseline's name), and speculative "
                     "(speculative_algorithm=...)")  # fmt: skip
    args.variants = variants
    if args.mode == "record" and not variants:
        ap.error("record needs at least one --variant")
    if min(args.batches) < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--batches, --num-prompts and --max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    rows, doc = record(args) if args.mode == "record" else replay(args)
    text = table(rows)
    print("\n" + text, flush=True)
    if args.out is not None:
        meta = {"command": shlex.join(["python", "benchmarks/spec_replay.py", *argv]),
                "date": datetime.now().astimezone().isoformat(timespec="seconds"),
                "commit": git_commit(), "device": device_name(), "recorded_on": doc["model"]}  # fmt: skip
        args.out.write_text(json.dumps({**meta, "rows": [r.__dict__ for r in rows],
                                        "markdown": text}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
