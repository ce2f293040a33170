"""Serving benchmark results: latency statistics, the per-run summary, the markdown table."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean, median and P99 (numpy's linear interpolation) in milliseconds; None when empty."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarize(results: list[Any], duration: float, load_before: float = 0.0) -> dict[str, Any]:
    """Throughput over the run's wall time; latencies over the completed requests."""
    ok = [r for r in results if r.ok]
    inp, out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error).most_common(5)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": inp / duration,
        "output_throughput": out / duration,
        "total_throughput": (inp + out) / duration,
        "mean_concurrency": sum(r.e2e for r in ok) / duration,
        "input_tokens": inp,
        "output_tokens": out,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "load_avg_before": load_before,
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _trio(m: dict[str, float | None], digits: int = 0) -> str:
    return " / ".join(_fmt(v, digits) for v in m.values())


def markdown_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: throughput, latency mean / P50 / P99, and the offline peer when run."""
    head = (
        "| max conc. | done / failed | req/s | input tok/s | output tok/s | total tok/s "
        "| TTFT ms | TPOT ms | ITL ms | E2E ms | offline output tok/s | served / offline |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        s, peer = run["server"], run.get("offline_peer")
        rows.append(
            f"| {run['max_concurrency'] or 'none'} | {s['completed']} / {s['failed']} "
            f"| {s['request_throughput']:.3f} | {s['input_throughput']:.1f} "
            f"| {s['output_throughput']:.1f} | {s['total_throughput']:.1f} | {_trio(s['ttft_ms'])} "
            f"| {_trio(s['tpot_ms'], 1)} | {_trio(s['itl_ms'], 1)} | {_trio(s['e2e_ms'])} "
            f"| {_fmt(peer['output_throughput']) if peer else 'n/a'} "
            f"| {_fmt(run.get('output_throughput_ratio'), 2)} |"
        )
    return "\n".join(rows) + "\n(latencies: mean / P50 / P99)"


def report_run(title: str, s: dict[str, Any]) -> None:
    print(
        f"{title}: {s['completed']} done, {s['failed']} failed in {s['duration_s']:.1f} s, "
        f"{s['output_throughput']:.1f} output tok/s, E2E mean {_fmt(s['e2e_ms']['mean'], 0)} ms "
        f"(load average before: {s['load_avg_before']:.2f})",
        flush=True,
    )
    for message, count in s["errors"].items():
        print(f"  {count} x error: {message}", flush=True)
