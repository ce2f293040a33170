"""The markdown summary of benchmarks/offline.py: run header, runs, headline ratios vs goals, engines."""

from __future__ import annotations

from typing import Any

from bench_utils import fmt, markdown_table
from offline_jobs import RunResult


def headline(results: list[RunResult]) -> list[list[str]]:
    """[metric, value, goal] rows from the runs that finished (issue 6's goals on the H200)."""
    by = {r.key: r for r in results if not r.error and r.output_tokens}
    rows: list[list[str]] = []

    def ratio(a: str, b: str) -> float | None:
        x, y = by.get(a), by.get(b)
        return x.output_tps / y.output_tps if x and y and x.output_tps and y.output_tps else None

    if "offline" in by:
        rows.append(["offline output tok/s", fmt(by["offline"].output_tps, 0), "≥ 14,000"])
    if (r := ratio("offline", "hf")) is not None:
        rows.append(["weft / HF transformers, output tok/s", f"{r:.2f}×", "≥ 10×"])
    if (r := ratio("prefix:on", "prefix:off")) is not None:
        rows.append(["shared prefixes: radix cache on / off, output tok/s", f"{r:.2f}×", "≥ 5×"])
    if (r := ratio("prefix:on", "prefix:on-per-request")) is not None:
        rows.append(
            [
                "shared prefixes, cache on: prefix read once per group / per request",
                f"{r:.2f}×",
                "-",
            ]
        )
    if (r := ratio("noshare:on", "noshare:off")) is not None:
        rows.append(
            ["no shared prefix: radix cache on / off, output tok/s", f"{r:.3f}", "0.99–1.01"]
        )
    con, free = by.get("constrained"), by.get("unconstrained")
    if con and free and con.ms_per_token and free.ms_per_token:
        over = 100 * (con.ms_per_token / free.ms_per_token - 1)
        value = f"{over:+.1f}% ({con.ms_per_token:.3f} vs {free.ms_per_token:.3f} ms)"
        rows.append(["JSON schema vs unconstrained, time per output token", value, "≤ +3%"])
        # the decode steps alone: the prefill's admission (which waits for the compile) apart
        decode = [r.extra.get("steps", {}).get("decode", {}).get("total_s") for r in (con, free)]
        if decode[0] and decode[1]:
            over = 100 * (decode[0] / con.output_tokens) / (decode[1] / free.output_tokens) - 100
            rows.append(["JSON schema vs unconstrained, decode steps' time per output token",
                         f"{over:+.1f}% ({decode[0]:.3f} vs {decode[1]:.3f} s)", "≤ +3%"])  # fmt: skip
    for run in results:
        if run.key.startswith("lora:") and run.key != "lora:base":
            if (r := ratio(run.key, "lora:base")) is not None:
                n = run.key.partition(":")[2]
                rows.append([f"LoRA, {n} adapters mixed / base model, output tok/s", f"{r:.3f}",
                             "≥ 1 / 1.15 at 8 adapters"])  # fmt: skip
    base = by.get("ablation:base")
    for run in results:
        if run.key.startswith("ablation:") and run.key != "ablation:base" and base:
            if (r := ratio(run.key, "ablation:base")) is not None:
                rows.append([f"ablation: [{run.engine}] / [{base.engine}], output tok/s",
                             f"{r:.2f}", "-"])  # fmt: skip
    eager = {run.engine.split(",")[0]: run.key for run in results if "eager" in run.engine}
    if "flashinfer" in eager and "triton" in eager:
        if (r := ratio(eager["flashinfer"], eager["triton"])) is not None:
            rows.append(["FlashInfer / Triton (both eager), output tok/s", f"{r:.2f}", "-"])
    return rows


def steps_text(steps: dict[str, Any] | None, kv: dict[str, Any] | None = None) -> str:
    """'extend 94 × 190.2 ms, decode 1000 × 28.1 ms, 0 retracted, KV held min 3% / mean 81% /
    max 97% of 402,848 slots' (the scheduler's own timing and KV use)."""
    if not steps:
        return "-"
    parts = [
        f"{kind} {steps[kind]['steps']} × {steps[kind]['mean_ms']:.1f} ms"
        for kind in ("extend", "decode")
        if steps[kind]["steps"]
    ]
    parts.append(f"{steps['retractions']} retracted")
    if kv and kv.get("mean") is not None:
        held = f"mean {100 * kv['mean']:.0f}%"
        if "max" in kv:
            held = f"min {100 * kv['min']:.0f}% / {held} / max {100 * kv['max']:.0f}%"
        parts.append(f"KV held {held} of {kv['pool_tokens']:,} slots")
    if "busy_periods" in steps:  # the scheduler idle: before, after, and in between
        parts.append(
            f"idle {steps['before_first_step_s']:.2f} s before the first step, "
            f"{steps['after_last_step_s']:.2f} s after the last, {steps['idle_between_s']:.2f} s "
            f"between {steps['busy_periods']} busy periods"
        )
    return ", ".join(parts)


def kv_points(results: list[RunResult]) -> list[str]:
    """A line per run with KV samples: '- offline [triton, CUDA graphs]: 0.0 s 3% (8), ...'."""
    lines = []
    for r in results:
        points = r.extra.get("kv", {}).get("points")
        if points and not r.error:
            text = ", ".join(f"{t:.1f} s {100 * f:.0f}% ({n})" for t, f, n in points)
            lines.append(f"- {r.key} [{r.engine}]: {text}")
    return lines


def runs_table(results: list[RunResult]) -> str:
    head = ["section", "run", "engine", "workload", "time s", "output tok/s", "ms / output tok",
            "cached tok", "steps (count × mean)", "note"]  # fmt: skip
    rows = [
        [
            r.section,
            r.label,
            r.engine,
            r.shape or "-",
            fmt(r.seconds or None, 2),
            fmt(r.output_tps, 0),
            fmt(r.ms_per_token, 3),
            "-" if r.error else fmt(r.cached_tokens),
            steps_text(r.extra.get("steps"), r.extra.get("kv")),
            (r.error or r.note).strip().replace("|", "/") or "-",
        ]  # fmt: skip
        for r in results
    ]
    return markdown_table(head, rows)


def report(meta: dict[str, Any], results: list[RunResult]) -> str:
    lines = [
        f"### weft offline benchmarks ({meta['date']})",
        "",
        f"- command: `{meta['command']}` (commit {meta.get('commit', 'unknown')})",
        f"- device: {meta['device']}; copy bandwidth measured in this run: "
        f"{meta['copy_GBps']:,.0f} GB/s (bytes read + written)",
        f"- model: {meta['model']}, dummy random weights; {meta['tokenizer']}; torch {meta['torch']}",
        f"- scaled down: {'; '.join(meta['scaled']) or 'nothing'}; budget {meta['budget_s']:.0f} s"
        + (f", took {meta['elapsed_s']:.0f} s" if "elapsed_s" in meta else " (run in progress)"),
        "- prompts are random token ids, greedy; HF's weights are random too (same config, other values)",
        "",
        runs_table(results),
    ]
    if over_time := kv_points(results):
        lines += ["", "KV pool held by requests over each run (seconds from its start: share, "
                  "requests running):", "", *over_time]  # fmt: skip
    if rows := headline(results):
        lines += ["", markdown_table(["metric", "value", "goal (H200, 8B)"], rows)]
    if engines := meta.get("engines"):
        rows = [[e["engine"], fmt(e["start_s"]), fmt(e.get("max_total_tokens")), fmt(e.get("page_size"))]
                for e in engines]  # fmt: skip
        lines += ["", markdown_table(["engine", "start s", "KV pool tokens", "page size"], rows)]
    return "\n".join(lines)
