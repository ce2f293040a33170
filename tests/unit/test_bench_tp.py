"""benchmarks/tp.py on CPU: the roofline arithmetic and a tiny TP=2 run end to end (gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules

import bench_utils  # noqa: E402
import tp as bench_tp  # noqa: E402


def test_weight_bytes_of_llama_3_70b() -> None:
    cfg = json.loads((BENCH / "configs" / "llama-3-70b" / "config.json").read_text())
    params = bench_tp.weight_bytes(cfg) / 2
    # Llama-3-70B has 70.55 B parameters; a decode step reads all but the input embedding (1.05 B)
    assert 69.4e9 < params < 69.6e9
    assert bench_tp.kv_bytes_per_token(cfg, tp=2) == 2 * 80 * 4 * 128 * 2


def test_tiny_tp2_run_reports_every_figure(tmp_path: Path) -> None:
    folder = bench_utils.write_config(tmp_path / "tiny", max_position_embeddings=256)
    report = bench_tp.main(
        [
            *("--config", str(folder), "--tp", "2", "--num", "3", "2"),
            *("--input-len", "10", "--output-len", "5", "--context-length", "64"),
            *("--latency-config", str(folder), "--latency-tp", "1"),
            *("--latency-input-len", "6", "--latency-output-len", "4"),
            *("--engine-arg", "enable_mixed_chunk=true"),
        ]
    )
    assert "TP=2: 3, 2 concurrent requests" in report
    assert "output throughput (tok/s)" in report
    assert "\n| 3 | " in report and "\n| 2 | " in report  # one row per concurrency
    assert "| 1 |" in report  # the latency row of tp 1
