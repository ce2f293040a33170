"""Offline weft.Engine benchmarks: throughput vs HF, prefix sharing, constrained decoding, ablations.

    python benchmarks/offline.py                  # chat: CPU, packaged SmolLM2 vs HF, concurrency 1 / 16
    python benchmarks/offline.py programs         # DSL programs on CPU, radix cache on vs off
    python benchmarks/offline.py offline --num-prompts 1000 --no-hf   # the headline run (GPU)
    python benchmarks/offline.py prefix --engine-arg tuning.gemv=off  # any EngineConfig field

Modes other than chat and programs run on `--model` (default benchmarks/configs/llama-3.1-8b)
with dummy random weights; a folder without a tokenizer gets a synthetic byte-level one of the
config's vocabulary size. Prompts are random token ids of fixed length; greedy; output lengths
fixed with ignore_eos.
  chat         the packaged model on CPU, chat prompts, concurrency 1 and N; HF `generate` peer.
  programs     few-shot and fork-heavy DSL programs on the packaged model, radix cache on / off.
  offline      N requests submitted at once: output tok/s. HF transformers `generate` (static cache,
               batch 64, random weights of the same config) on the first requests: weft / HF.
  prefix       G groups × R requests sharing a P-token prefix (+ Q-token question, O outputs), and
               requests with no shared prefix; radix cache on, then off (two engines): on / off.
  constrained  a batch of JSON-schema requests, then the same prompts unconstrained with the same
               per-request output lengths: time per output token and the overhead.
  ablations    one workload on the default engine and on variants: CUDA graphs off, Triton vs
               FlashInfer (both eager), any --variant.
  lora         one workload on the base model (the merged adapter's speed too), then with each
               --lora-adapters count of random rank --lora-rank adapters (PEFT folders written
               here), request i under adapter i mod n: mixed-adapter batches. Not in `all`.
  all          every engine mode above, scaled to fit --budget-s (printed); one engine per
               configuration.
Each engine mode measures the copy bandwidth (the memory ceiling) and ends with markdown tables;
each run reports its steps, retractions and the KV pool's use (min / mean / max, and points over
the run). `benchmarks/offline_baseline.sh` runs a baseline commit's benchmark beside this tree's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from bench_utils import copy_bandwidth, device_name, git_commit, model_folder, parse_kv
from offline_jobs import RunResult, hf_peer
from offline_plan import MODES, EngineSpec, Plan, build_plan
from offline_report import report

REPO = Path(__file__).resolve().parents[1]
SPENT = "skipped: time budget spent"
# flag: (default, in the all mode): the published workloads, and what fits one 8-minute device call
SCALED = {"num_prompts": (1000, 500), "groups": (64, 16), "noshare_prompts": (128, 64)}

##### Running the plan #####


class Runner:
    """Runs the plan's engines (and the HF peer) one at a time within the time budget: no step
    starts after --budget-s; requests still running --grace-s later are aborted."""

    def __init__(self, args: argparse.Namespace, plan: Plan, meta: dict[str, Any]) -> None:
        self.args, self.plan, self.meta = args, plan, meta
        self.soft = args.t0 + args.budget_s
        self.hard = self.soft + args.grace_s
        self.results: list[RunResult] = []
        meta["engines"] = []

    def steps(self) -> list[EngineSpec | None]:
        """Engines in plan order, then the HF peer (None): the step whose time is least known
        (transformers may torch.compile for minutes) goes last, cut at the hard deadline."""
        return [*self.plan.engines.values(), *([None] if self.args.hf else [])]

    def run(self) -> list[RunResult]:
        for step in self.steps():
            if step is None:
                self.run_hf()
            else:
                self.run_engine(step)
            self.write()
        self.results += self.plan.skipped
        return self.results

    def run_hf(self) -> None:
        label = "HF transformers generate"
        if self.over_budget():
            return self.add(RunResult("offline", "hf", label, "HF", "", error=SPENT))
        self.log("HF transformers peer")
        try:
            work = self.args.offline_work.head(self.args.hf_num_prompts)
            args = self.args
            self.add(hf_peer(args.folder, work, args.hf_batch, args.hf_compile, self.hard))
        except Exception as e:
            traceback.print_exc()
            self.add(RunResult("offline", "hf", label, "HF", "", error=f"{type(e).__name__}: {e}"))

    def run_engine(self, spec: EngineSpec) -> None:
        import weft

        if self.over_budget():
            return self.fail_all(spec, SPENT)
        self.log(f"starting engine [{spec.label}]")
        t0 = time.perf_counter()
        try:
            engine = weft.Engine(**spec.kwargs)
        except Exception as e:
            traceback.print_exc()
            return self.fail_all(spec, f"engine failed: {type(e).__name__}: {e}")
        info = {"engine": spec.label, "start_s": time.perf_counter() - t0, **engine.server_info}
        self.meta["engines"].append(info)
        self.log(f"ready in {info['start_s']:.1f} s: {json.dumps(engine.server_info)}")
        try:
            for section, key, job in spec.jobs:
                if self.over_budget():
                    self.add(RunResult(section, key, key, spec.label, "", error=SPENT))
                    continue
                try:
                    for r in job(engine, self.hard, spec.label):
                        self.add(r)
                except Exception as e:
                    traceback.print_exc()
                    error = f"{type(e).__name__}: {e}"
                    self.add(RunResult(section, key, key, spec.label, "", error=error))
                self.write()
        finally:
            engine.shutdown()

    def fail_all(self, spec: EngineSpec, error: str) -> None:
        for section, key, _ in spec.jobs:
            self.add(RunResult(section, key, key, spec.label, "", error=error))

    def over_budget(self) -> bool:
        return time.monotonic() >= self.soft

    def add(self, r: RunResult) -> None:
        self.results.append(r)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.to_dict().items()}
        shown.pop("output_lengths", None)
        print("  " + json.dumps(shown, ensure_ascii=False), flush=True)

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.args.t0:6.1f} s] {text}", flush=True)

    def write(self) -> None:
        """The JSON results and markdown so far (a run cut off by a time limit still leaves them)."""
        if self.args.output_file:
            text = report(self.meta, self.results)
            results = [r.to_dict() for r in self.results]
            out = {**self.meta, "results": results, "markdown": text}
            Path(self.args.output_file).write_text(json.dumps(out, indent=2, ensure_ascii=False))


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    def opt(group: Any, flag: str, default: Any, text: str = "", **kw: Any) -> None:
        shown = "" if default is None or isinstance(default, bool) else " (default: %(default)s)"
        group.add_argument(flag, default=default, help=text + shown, **kw)

    run = ap.add_argument_group("run")
    run.add_argument("mode", nargs="?", default="chat", choices=MODES, help="what to measure "
                     "(see above; default: chat)")  # fmt: skip
    opt(run, "--model", None, "chat, programs: HF folder or .gguf (default: SmolLM2); else a "
        "config folder (default: benchmarks/configs/llama-3.1-8b)")  # fmt: skip
    opt(run, "--load-format", "dummy", "weights for the non-chat modes", choices=["dummy", "auto"])
    opt(run, "--engine-arg", [], "an EngineConfig field for every engine", action="append",
        metavar="KEY=VALUE")  # fmt: skip
    opt(run, "--budget-s", 420.0, "start no step after this many seconds", type=float)
    opt(run, "--grace-s", 60.0, "abort requests still running this long after", type=float)
    opt(run, "--seed", 0, "seed of the random prompts", type=int)
    opt(run, "--output-file", None, "JSON results + markdown, rewritten after each step")
    off = ap.add_argument_group("offline (and chat)")
    opt(off, "--num-prompts", None, "requests (offline 1000, 500 in all; chat 16; programs 16 "
        "few-shot, a quarter as many fork-heavy)", type=int)  # fmt: skip
    opt(off, "--input-len", 1000, "prompt tokens", type=int)
    opt(off, "--output-len", 1000, "output tokens", type=int)
    opt(off, "--no-hf", True, "skip the HF transformers peer", dest="hf", action="store_false")
    opt(off, "--hf-num-prompts", 64, "HF: the first N offline requests", type=int)
    opt(off, "--hf-batch", 64, "HF: requests per generate call", type=int)
    opt(off, "--hf-compile", "auto", "auto: transformers' own choice", choices=["auto", "off"])
    opt(off, "--new-tokens", 64, "chat: output tokens", type=int)
    opt(off, "--program-tokens", 8, "programs: max_new_tokens of each gen", type=int)
    opt(off, "--concurrency", [1, 16], "chat: a run each", type=int, nargs="+")
    pre = ap.add_argument_group("prefix")
    opt(pre, "--groups", None, "G groups sharing a prefix (64; 16 in all)", type=int)
    opt(pre, "--group-size", 16, "R requests per group", type=int)
    opt(pre, "--prefix-len", 2048, "P shared tokens", type=int)
    opt(pre, "--question-len", 128, "Q own tokens per request", type=int)
    opt(pre, "--prefix-output-len", 256, "O output tokens", type=int)
    opt(
        pre, "--noshare-prompts", None, "requests of P+Q unshared tokens (128; 64 in all)", type=int
    )
    con = ap.add_argument_group("constrained")
    opt(con, "--constrained-batch", 32, "JSON-schema requests", type=int)
    opt(con, "--constrained-input-len", 256, "prompt tokens", type=int)
    opt(con, "--constrained-max-tokens", 256, "max_new_tokens", type=int)
    abl = ap.add_argument_group("ablations")
    opt(abl, "--ablation-prompts", 64, "requests", type=int)
    opt(abl, "--ablation-input-len", 512, "prompt tokens", type=int)
    opt(abl, "--ablation-output-len", 256, "output tokens", type=int)
    opt(abl, "--ablation-backends", ["triton", "flashinfer"], "eager backends", nargs="*")
    opt(abl, "--variant", [], "another engine, e.g. 'lpm:schedule_policy=lpm'", action="append",
        metavar="NAME:KEY=VALUE,...")  # fmt: skip
    lo = ap.add_argument_group("lora")
    opt(lo, "--lora-prompts", 256, "requests (of --input-len / --output-len)", type=int)
    opt(lo, "--lora-adapters", [1, 8, 32], "adapters mixed in a run, a run each", type=int,
        nargs="+")  # fmt: skip
    opt(lo, "--lora-rank", 16, "their rank (every projection)", type=int)
    args = ap.parse_args(argv)
    args.engine_arg = parse_kv(args.engine_arg)
    args.scaled = []
    if args.mode in ("chat", "programs"):
        args.num_prompts = args.num_prompts or 16
        return args
    for name, (full, in_all) in SCALED.items():
        if getattr(args, name) is None:
            value = in_all if args.mode == "all" else full
            setattr(args, name, value)
            if value != full:
                args.scaled.append(f"--{name.replace('_', '-')} {full} → {value}")
    args.model = args.model or str(REPO / "benchmarks/configs/llama-3.1-8b")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.mode == "chat":
        from offline_chat import run_chat

        run_chat(args)
        return 0
    if args.mode == "programs":
        from offline_programs import run_programs

        run_programs(args.model, args.num_prompts, args.program_tokens)
        return 0
    args.t0 = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()  # the engines size their KV pools from the free memory
    else:
        bandwidth = copy_bandwidth(256 << 20, 5, "cpu")
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/offline.py", *argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"), "commit": git_commit(),
        "device": device_name(), "copy_GBps": bandwidth / 1e9, "model": args.model,
        "scaled": args.scaled, "budget_s": args.budget_s, "torch": torch.__version__,
    }  # fmt: skip
    print(f"{meta['device']}: copy bandwidth {meta['copy_GBps']:,.0f} GB/s (read + write)")
    for line in args.scaled:
        print(f"scaled down for the all mode: {line}", flush=True)
    with tempfile.TemporaryDirectory(prefix="weft-bench-") as tmp:
        folder, meta["tokenizer"] = model_folder(args.model, Path(tmp))
        args.folder, args.tmp = str(folder), tmp
        plan = build_plan(args, device, json.loads((folder / "config.json").read_text()))
        args.hf = args.hf and args.mode in ("offline", "all")
        runner = Runner(args, plan, meta)
        results = runner.run()
    meta["elapsed_s"] = time.monotonic() - args.t0
    runner.write()
    print("\n" + report(meta, results), flush=True)
    return 1 if any(r.error and not r.error.startswith("skipped") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
