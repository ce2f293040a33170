"""benchmarks/draft.py on CPU with a tiny config: every batch size and case is timed, greedy and
sampled, and the results are written (what the GPU run does, smaller and eagerly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import bench_utils  # noqa: E402
import draft  # noqa: E402


@pytest.mark.parametrize("sampled", [False, True])
def test_draft_benchmark_runs_on_cpu(tmp_path: Path, sampled: bool) -> None:
    config = bench_utils.write_config(tmp_path / "tiny")
    argv = ["--config", str(config), "--batches", "1", "3", "--k", "3", "--context", "20",
            "--warmup", "1", "--reps", "2", "--out", str(tmp_path / "out")]  # fmt: skip
    results = draft.main(argv + (["--sampled"] if sampled else []))
    assert [(r["batch"], r["case"]) for r in results] == [
        (b, c) for b in (1, 3) for c in ("steady", "full accept")
    ]
    assert all(r["ms"] > 0 and r["ms_per_step"] == r["ms"] / 3 for r in results)
    assert json.loads((tmp_path / "out/results.json").read_text()) == results
    assert "| default | no | 3 | full accept | 3 |" in (tmp_path / "out/results.md").read_text()
