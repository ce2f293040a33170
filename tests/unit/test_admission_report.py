"""What reports admission: the scheduler's KV-use samples (thinned evenly when full), the offline
benchmark's KV use over a run (mean, min, max, points) and its report lines, and the Prometheus
retraction counter and new-token ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from weft.runtime.scheduler import stats
from weft.runtime.server.http.metrics import Metrics

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules

import offline_jobs  # noqa: E402
import offline_report  # noqa: E402


def test_kv_samples_thin_evenly_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(float(t) for t in range(10_000))
    monkeypatch.setattr(stats.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(stats, "KV_SAMPLES", 8)
    usage = stats.KVUsage()
    usage.interval = 1.0
    for i in range(20):  # t = 0..19, one a second
        usage.record(held=i, running=1)
    times = [t for t, _, _ in usage.samples]
    assert usage.interval == 4.0  # doubled twice: at 8 samples, then at 8 again
    assert times == [0.0, 4.0, 9.0, 13.0, 19.0]  # from the first to the last, none far apart
    assert [h for _, h, _ in usage.samples] == [0, 4, 9, 13, 19]


def state(steps: int, held_sum: int, samples: list[list[float]]) -> dict:
    return {"max_total_tokens": 1000, "extend_steps": 1, "decode_steps": steps,
            "kv_held_step_sum": held_sum, "kv_samples": samples}  # fmt: skip


def test_kv_usage_of_a_run() -> None:
    before = state(10, 5_000, [])
    samples = [[t, 100.0 * t, int(t)] for t in range(0, 21)]  # held 100 t at time t
    after = state(110, 5_000 + 100 * 600, samples)
    kv = offline_jobs.kv_usage(before, after, start=5.0, end=15.0, points=3)
    assert kv["mean"] == 0.6  # 60,000 slot-steps over 100 steps of a 1000-slot pool
    assert (kv["min"], kv["max"], kv["samples"]) == (0.5, 1.5, 11)
    assert kv["points"] == [[0.0, 0.5, 5], [5.0, 1.0, 10], [10.0, 1.5, 15]]
    empty = offline_jobs.kv_usage(before, state(10, 5_000, []), 0.0, 1.0)
    assert empty == {"pool_tokens": 1000, "samples": 0, "mean": None}


def test_report_shows_kv_use_and_retractions() -> None:
    steps = {"retractions": 3, "extend": {"steps": 2, "mean_ms": 5.0},
             "decode": {"steps": 10, "mean_ms": 1.0}}  # fmt: skip
    kv = {"pool_tokens": 402848, "mean": 0.81, "min": 0.03, "max": 0.974, "samples": 3,
          "points": [[0.0, 0.03, 8], [1.5, 0.974, 250]]}  # fmt: skip
    text = offline_report.steps_text(steps, kv)
    assert text.endswith("3 retracted, KV held min 3% / mean 81% / max 97% of 402,848 slots")
    run = offline_jobs.RunResult("offline", "offline", "x", "triton", "2 × 1/1", extra={"kv": kv})
    assert offline_report.kv_points([run]) == ["- offline [triton]: 0.0 s 3% (8), 1.5 s 97% (250)"]


def test_prometheus_counts_retractions_and_shows_the_ratio() -> None:
    m = Metrics()
    base = {"num_running": 0, "num_waiting": 0, "max_total_tokens": 100, "free_tokens": 100,
            "protected_tokens": 0}  # fmt: skip
    m.update_scheduler({**base, "retractions": 2, "new_token_ratio": 0.5})
    m.update_scheduler({**base, "retractions": 5, "new_token_ratio": 0.25})
    text = generate_latest(m.registry).decode()
    assert "weft_retracted_requests_total 5.0" in text
    assert "weft_new_token_ratio 0.25" in text
