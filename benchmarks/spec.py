"""Speculative decoding against plain decoding: output tokens/s, acceptance and identical greedy
outputs per workload, batch size and engine variant (issue 41).

    python benchmarks/spec.py                                   # packaged SmolLM2 on CPU, bs 1
    python benchmarks/spec.py --model ~/.cache/weft-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --workloads code-edit sharegpt --num-prompts 4 --out /tmp/spec
    python benchmarks/spec.py --model benchmarks/configs/llama-3.1-8b \
        --engine-arg load_format=dummy --batches 1 8 32 64 --ignore-eos --out $OUT/spec
    python benchmarks/spec.py --variant plain: --variant ngram:speculative_algorithm=ngram \
        --variant "draft:speculative_algorithm=draft,speculative_draft_model_path=PATH"

Each variant (`--variant NAME:KEY=VALUE,...`, EngineConfig fields on top of --engine-arg; default
`plain:` and `ngram:speculative_algorithm=ngram`) gets its own engine, one after the other; the
first variant is the baseline. Every workload runs the same requests on each: greedy,
--max-new-tokens each, real text through the tokenizer's chat template.
  code-edit  generated Python snippets (20-60 lines) to rename, annotate, document or relog: the
             answer repeats most of the prompt (n-gram lookup's home ground)
  sharegpt   the first human turns of ShareGPT (--sharegpt; skipped with a message when absent)
  json       JSON-schema constrained records (`json_schema` in the sampling parameters)
At batch size B, max(--num-prompts, B) requests run in waves of B (one generate call each, all
submitted at once), after a short warm-up wave; the radix cache is flushed before each run.
Reported per (workload, batch, variant): output tokens/s over the waves' wall time; for a
speculative variant the acceptance rate (accepted / drafted) and the mean accepted length
((accepted + verify steps) / verify steps), from the requests' meta_info; the speedup over the
baseline's tokens/s and the number of requests whose greedy output ids equal the baseline's.
With `load_format=dummy` (random weights; a config folder without a tokenizer gets a synthetic
one) acceptance says nothing about real text, but the verify steps cost what they really do.
--out DIR gets spec.json and spec.md, rewritten after each run.
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
from bench_utils import device_name, git_commit, local_copy_bandwidth, merge_kwargs, model_folder
from bench_utils import parse_kv as parse_engine_args
from spec_report import Row, compare, report
from spec_workloads import WORKLOADS, Workload, WorkloadSpec, build_workload

from weft.runtime.loader.synthetic_tokenizer import has_tokenizer

SHAREGPT = Path.home() / ".cache/weft-models/sharegpt.jsonl"
DEFAULT_VARIANTS = ["plain:", "ngram:speculative_algorithm=ngram"]
WARMUP_TOKENS = 8
DUMMY_NOTE = ("random weights (load_format=dummy): acceptance and outputs say nothing about real "
              "text; the cost of the verify steps is real")  # fmt: skip

##### Variants #####


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'NAME:KEY=VALUE,...' -> (NAME, engine keyword arguments); 'NAME:' has none."""
    name, sep, pairs = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE,..., got {text!r}")
    return name.strip(), parse_engine_args(pairs.split(",")) if pairs.strip() else {}


def is_speculative(kwargs: dict[str, Any]) -> bool:
    return kwargs.get("speculative_algorithm") not in (None, "", "none")


##### One run #####


def state_delta(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int, int]:
    """(decode steps, verify steps, their µs) between two get_state answers."""
    d = {k: int(after.get(k, 0)) - int(before.get(k, 0))
         for k in ("decode_steps", "verify_steps", "decode_us", "verify_us")}  # fmt: skip
    return d["decode_steps"], d["verify_steps"], d["decode_us"] + d["verify_us"]


def measure(engine: Any, work: Workload, batch: int, n: int, variant: str, speculative: bool,
            warmup: bool) -> Row:  # fmt: skip
    """n requests of `work` in waves of `batch` on `engine`: wall time, tokens, steps, drafts."""
    prompts = work.take(n)
    waves = [prompts[i : i + batch] for i in range(0, n, batch)]
    if warmup:
        short = {**work.params, "max_new_tokens": min(WARMUP_TOKENS, work.params["max_new_tokens"])}
        engine.generate(waves[0], short)
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused: requests still in flight")
    row = Row(work.name, batch, variant, speculative, requests=n)
    before = engine.get_state()
    for wave in waves:
        t0 = time.perf_counter()
        outs = engine.generate(wave, work.params)
        row.wall_s += time.perf_counter() - t0
        for out in outs:
            meta = out["meta_info"]
            row.output_ids.append(list(out["output_ids"]))
            row.output_tokens += int(meta["completion_tokens"])
            row.prompt_tokens += int(meta["prompt_tokens"])
            row.spec_verify_ct += int(meta.get("spec_verify_ct", 0))
            row.spec_draft_tokens += int(meta.get("spec_draft_tokens", 0))
            row.spec_accepted_tokens += int(meta.get("spec_accepted_tokens", 0))
    row.decode_steps, row.verify_steps, row.step_us = state_delta(before, engine.get_state())
    return row


##### The benchmark #####


class Bench:
    """Runs every variant's engine over the workloads and batch sizes, one engine at a time;
    collects the rows and rewrites the JSON and markdown after each."""

    def __init__(self, args: argparse.Namespace, meta: dict[str, Any], model: str | None) -> None:
        self.args, self.meta, self.model = args, meta, model
        self.rows: list[Row] = []
        self.spec = WorkloadSpec(
            num_prompts=max([args.num_prompts, *args.batches]),
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            snippet_lines=tuple(args.snippet_lines),
            sharegpt=args.sharegpt,
            seed=args.seed,
        )

    def run(self) -> list[Row]:
        for name, over in self.args.variants:
            self.run_variant(name, merge_kwargs(self.args.engine_arg, over))
        compare(self.rows, self.meta["baseline"])
        self.write()
        return self.rows

    def run_variant(self, name: str, kwargs: dict[str, Any]) -> None:
        import weft

        speculative = is_speculative(kwargs)
        self.log(f"starting engine [{name}]: {kwargs}")
        t0 = time.perf_counter()
        try:
            engine = weft.Engine(self.model, **kwargs)
        except Exception as e:
            traceback.print_exc()
            return self.fail(name, speculative, f"engine failed: {type(e).__name__}: {e}")
        info = {"variant": name, "start_s": time.perf_counter() - t0,
                "overlap": engine.config.resolved_overlap, **engine.server_info}  # fmt: skip
        self.meta["engines"].append(info)
        self.log(f"ready in {info['start_s']:.1f} s")
        try:
            for wname in self.args.workloads:
                try:
                    work = build_workload(wname, engine.tokenizer, self.spec)
                except Exception as e:
                    traceback.print_exc()
                    self.fail(name, speculative, f"{type(e).__name__}: {e}", [wname])
                    continue
                self.meta["workloads"][wname] = work.note
                for b in self.args.batches:
                    n = max(self.args.num_prompts, b)
                    try:
                        row = measure(engine, work, b, n, name, speculative, self.args.warmup)
                    except Exception as e:
                        traceback.print_exc()
                        row = Row(wname, b, name, speculative, error=f"{type(e).__name__}: {e}")
                    self.add(row)
        finally:
            engine.shutdown()

    def fail(self, variant: str, speculative: bool, error: str,
             workloads: list[str] | None = None) -> None:  # fmt: skip
        for w in workloads or self.args.workloads:
            for b in self.args.batches:
                self.add(Row(w, b, variant, speculative, error=error))

    def add(self, row: Row) -> None:
        self.rows.append(row)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.to_dict().items()}
        shown.pop("output_lengths")
        print("  " + json.dumps(shown), flush=True)
        self.write()

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.args.t0:6.1f} s] {text}", flush=True)

    def write(self) -> None:
        """spec.json (meta, rows, markdown) and spec.md under --out, when given."""
        if self.args.out is None:
            return
        self.args.out.mkdir(parents=True, exist_ok=True)
        text = report(self.meta, self.rows)
        data = {**self.meta, "rows": [r.to_dict() for r in self.rows], "markdown": text}
        (self.args.out / "spec.json").write_text(json.dumps(data, indent=2, ensure_ascii=False))
        (self.args.out / "spec.md").write_text(text + "\n")


##### CLI #####


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", help="HF folder, .gguf file, or a config folder with "
                    "load_format=dummy (default: the packaged SmolLM2)")  # fmt: skip
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for every variant (load_format=dummy, ...)")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="an engine with these fields on top; the first is the baseline "
                    f"(default: {' '.join(DEFAULT_VARIANTS)})")  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1],
                    help="concurrency: requests per generate call (default: 1)")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=16,
                    help="requests per run, at least the batch size (default: 16)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request generates --max-new-tokens (random weights)")  # fmt: skip
    ap.add_argument("--snippet-lines", type=int, nargs=2, default=[20, 60], metavar=("LO", "HI"),
                    help="code-edit: lines of a snippet (default: 20 60)")  # fmt: skip
    ap.add_argument("--sharegpt", type=Path, default=SHAREGPT, help="default: %(default)s")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help=f"skip the {WARMUP_TOKENS}-token warm-up wave before each run")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="of the generated prompts")
    ap.add_argument("--out", type=Path, help="folder for spec.json and spec.md")
    args = ap.parse_args(argv)
    try:
        args.engine_arg = parse_engine_args(args.engine_arg)
        args.variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    names = [n for n, _ in args.variants]
    if len(set(names)) != len(names):
        ap.error(f"variant names must differ, got {names}")
    if min(args.batches) < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--batches, --num-prompts and --max-new-tokens must be >= 1")
    if not 4 <= args.snippet_lines[0] <= args.snippet_lines[1]:
        ap.error(f"--snippet-lines needs 4 <= LO <= HI, got {args.snippet_lines}")
    args.workloads = list(dict.fromkeys(args.workloads))
    return args


def notes(args: argparse.Namespace) -> list[str]:
    """What a reader must know to read the numbers: random weights."""
    out = []
    if any(merge_kwargs(args.engine_arg, kw).get("load_format") == "dummy"
           for _, kw in args.variants):  # fmt: skip
        out.append(DUMMY_NOTE)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    args.t0 = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if "sharegpt" in args.workloads and not args.sharegpt.is_file():
        print(f"skipping the sharegpt workload: no file at {args.sharegpt} (fetch it with "
              "shared/tools/fetch-models.sh sharegpt, or pass --sharegpt PATH)", flush=True)  # fmt: skip
        args.workloads.remove("sharegpt")
        skipped = [f"sharegpt skipped: no file at {args.sharegpt}"]
    else:
        skipped = []
    bandwidth = local_copy_bandwidth()
    if device == "cuda":
        torch.cuda.empty_cache()  # the engines size their KV pools from the free memory
    meta: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/spec.py", *argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"), "commit": git_commit(),
        "device": device_name(), "copy_GBps": bandwidth / 1e9, "torch": torch.__version__,
        "model": args.model or "packaged SmolLM2-135M-Instruct", "baseline": args.variants[0][0],
        "variants": {n: ",".join(f"{k}={v}" for k, v in kw.items()) or "(engine args only)"
                     for n, kw in args.variants},
        "engine_args": args.engine_arg, "workloads": {}, "engines": [],
        "notes": notes(args) + skipped,
    }  # fmt: skip
    for line in meta["notes"]:
        print(f"NOTE: {line}", flush=True)
    with tempfile.TemporaryDirectory(prefix="weft-spec-") as tmp:
        model = args.model
        if model is not None and Path(model).is_dir() and not has_tokenizer(Path(model)):
            folder, meta["tokenizer"] = model_folder(model, Path(tmp))
            model = str(folder)
        rows = Bench(args, meta, model).run()
    print("\n" + report(meta, rows), flush=True)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
