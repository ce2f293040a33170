"""The headline suite: the figures of BENCHMARKS.md's table, each next to its peer or ceiling
measured in the same run, from one script on the lent GPU.

    python benchmarks/headline.py --parts copy,decode,offline --out "$OUT"   # ~7-8 min (call 1)
    python benchmarks/headline.py --parts prefix,constrained --out "$OUT"    # ~7-8 min (call 2)
    python benchmarks/headline.py --parts copy,fp8_decode,fp8_offline --out "$OUT"  # FP8 (call 3)
    python benchmarks/headline.py --merge a/headline.json b/headline.json --out benchmarks

Each part runs another entry point as a subprocess (the command the table names), under its own
time limit and within --budget-s in all, and prints its output as it goes:
  copy         kernel.py copy: device-to-device copy bandwidth, the ceiling
  decode       step.py decode: Llama-3.1-8B shape, bf16, batch 1 and 64 at 2048 context, triton +
               CUDA graphs, pipelined, against its roofline; FlashInfer + graphs as the peer where
               it is installed
  offline      offline.py offline: 1000 requests x 1000 in / 1000 out, fp8 KV, 512 running
  prefix       offline.py prefix: 64 groups x 16 requests sharing a 2048-token prefix + a
               128-token question, 256 out, fp8 KV, 1024 running; radix cache on / off
  constrained  offline.py constrained: 32 JSON-schema requests against the same unconstrained
  fp8_decode   step.py decode: the decode part's steps with bf16 weights + KV and with FP8 W8A8
               weights (quantized on the GPU at load) + fp8 KV, each against its own roofline
  fp8_offline  offline.py offline: the offline part with FP8 W8A8 weights (its KV is fp8 already)
The workloads are those of the published figures. Writes DIR/headline.json (every part's result
and the rows), DIR/headline.md (the rows BENCHMARKS.md takes) and DIR/headline.png (with
matplotlib); each part's log and JSON under DIR/parts/. --merge combines the results of several
calls (later ones win per part) into one table and plot, on any machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headline_report import markdown, plot, rows_of, to_json

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
FP8 = ("--engine-arg", "kv_cache_dtype=fp8_e4m3")


@dataclass(frozen=True)
class Part:
    """One subprocess of the suite: `python benchmarks/<argv...> --output-file FILE`."""

    name: str
    argv: tuple[str, ...]
    limit_s: int  # its time limit (less when the budget has less left)
    budget_flags: bool = False  # offline.py: pass its own --budget-s / --grace-s inside the limit


def parts(flashinfer: bool) -> dict[str, Part]:
    """The suite, in order; `flashinfer`: add FlashInfer's decode step as the peer."""
    backends = ("triton+graph", "flashinfer+graph") if flashinfer else ("triton+graph",)
    running = ("--engine-arg", "max_running_requests={n}", "--engine-arg", "cuda_graph_max_bs={n}")
    return {
        "copy": Part("copy", ("kernel.py", "copy"), 90),
        "decode": Part(
            "decode",
            (
                "step.py",
                "decode",
                "--batches",
                "1",
                "64",
                "--context",
                "2048",
                "--reps",
                "20",
                "--backends",
                *backends,
            ),
            260,
        ),  # fmt: skip
        "offline": Part(
            "offline",
            (
                "offline.py",
                "offline",
                "--num-prompts",
                "1000",
                "--no-hf",
                *FP8,
                *(a.format(n=512) for a in running),
            ),
            330,
            True,
        ),  # fmt: skip
        "prefix": Part(
            "prefix",
            (
                "offline.py",
                "prefix",
                "--groups",
                "64",
                "--group-size",
                "16",
                *FP8,
                *(a.format(n=1024) for a in running),
            ),
            420,
            True,
        ),  # fmt: skip
        "constrained": Part("constrained", ("offline.py", "constrained", "--no-hf"), 150, True),
        # FP8 W8A8 weights + fp8 KV beside bf16 weights + bf16 KV, each beside its roofline
        "fp8_decode": Part(
            "fp8_decode",
            (
                "step.py",
                "decode",
                "--batches",
                "1",
                "64",
                "--context",
                "2048",
                "--reps",
                "20",
                "--backends",
                "triton+graph",
                "--variant",
                "bf16:",
                "--variant",
                "fp8:quantization=fp8,kv_cache_dtype=fp8_e4m3",
            ),
            300,
        ),  # fmt: skip
        "fp8_offline": Part(
            "fp8_offline",
            (
                "offline.py",
                "offline",
                "--num-prompts",
                "1000",
                "--no-hf",
                *FP8,
                "--engine-arg",
                "quantization=fp8",
                *(a.format(n=512) for a in running),
            ),
            330,
            True,
        ),  # fmt: skip
    }


def command(part: Part, limit_s: float) -> list[str]:
    """The part's argv from the repo root, with offline.py's own budget inside the time limit
    (no step starts after it, and it writes what finished before it is cut)."""
    argv = ["python", f"benchmarks/{part.argv[0]}", *part.argv[1:]]
    if part.budget_flags:
        argv += ["--budget-s", str(max(30, int(limit_s) - 75)), "--grace-s", "45"]
    return argv


def run_part(part: Part, limit_s: float, out: Path) -> dict[str, Any] | None:
    """Runs one part, its output shown and logged; its JSON result (with the command) or None."""
    argv = command(part, limit_s)
    result_file, log_file = out / "parts" / f"{part.name}.json", out / "parts" / f"{part.name}.log"
    result_file.unlink(missing_ok=True)
    shown = shlex.join(argv)
    print(f"\n== {part.name} (limit {limit_s:.0f} s): {shown}", flush=True)
    t0 = time.monotonic()
    with log_file.open("w") as log:
        proc = subprocess.Popen([sys.executable, *argv[1:], "--output-file", str(result_file)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        assert proc.stdout is not None
        watchdog = threading.Timer(limit_s, proc.kill)  # NOTE: offline.py writes as it goes
        watchdog.start()
        try:
            for line in proc.stdout:  # ends when the process does
                log.write(line)
                if not line.startswith("[transformers]") and "Warning" not in line:
                    print(f"  {line}", end="", flush=True)
        finally:
            watchdog.cancel()
            proc.wait()
    took = time.monotonic() - t0
    print(f"== {part.name}: exit {proc.returncode} after {took:.0f} s", flush=True)
    if not result_file.is_file():
        return None
    result = json.loads(result_file.read_text())
    result["command"] = shown  # as run from the repo root
    result["exit_code"], result["elapsed_s"] = proc.returncode, round(took, 1)
    return dict(result)


def write(results: dict[str, dict[str, Any]], out: Path) -> None:
    """headline.json, headline.md and (with matplotlib) headline.png in `out`."""
    rows = rows_of(results)
    (out / "headline.json").write_text(
        json.dumps({"parts": results, "rows": to_json(rows)}, indent=1, ensure_ascii=False)
    )
    (out / "headline.md").write_text(markdown(rows, results))
    drawn = plot(results, out / "headline.png")
    print(f"\nwrote {out / 'headline.json'}, {out / 'headline.md'}"
          + (f", {out / 'headline.png'}" if drawn else " (no plot: matplotlib is not installed)"))  # fmt: skip
    print("\n" + markdown(rows, results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    names = list(parts(False))
    ap.add_argument(
        "--parts", default=",".join(names), help="comma-separated, of " + ", ".join(names)
    )
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "headline-out"),
                    help="the results folder (default: $OUT, else ./headline-out)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="all parts together, seconds (a device call allows 600)")  # fmt: skip
    ap.add_argument("--merge", type=Path, nargs="+", default=[], metavar="JSON",
                    help="headline.json files of earlier calls: their parts first")  # fmt: skip
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(args.parts) - set(names)):
        ap.error(f"unknown parts: {', '.join(unknown)} (known: {', '.join(names)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    for path in args.merge:
        results.update(json.loads(path.read_text())["parts"])
    (args.out / "parts").mkdir(parents=True, exist_ok=True)
    if args.merge and "--parts" not in (argv if argv is not None else sys.argv[1:]):
        args.parts = []  # --merge alone: only the table and the plot
    suite = parts(flashinfer=importlib.util.find_spec("flashinfer") is not None)
    t0, failed = time.monotonic(), []
    for name in args.parts:
        left = args.budget_s - (time.monotonic() - t0)
        if left < 30:
            print(f"\n== {name}: skipped, {left:.0f} s of the budget left", flush=True)
            failed.append(name)
            continue
        result = run_part(suite[name], min(suite[name].limit_s, left), args.out)
        if result is None or result["exit_code"] != 0:
            failed.append(name)
        if result is not None:
            results[name] = result
            write(results, args.out)  # after each part: a later cut keeps what finished
    if not args.parts:
        write(results, args.out)
    if failed:
        print(f"\nparts that failed or were cut: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
