"""benchmarks/headline.py: the suite's commands, the table rows from each part's result, the
merge of two calls, the plot, and the suite run end to end on CPU with tiny parts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import bench_utils  # noqa: E402
import headline  # noqa: E402
import headline_report  # noqa: E402

GPU = {"device": "NVIDIA H200", "date": "2026-12-05T10:00:00+00:00", "commit": "abc1234"}
DECODE = {**GPU, "copy_GBps": 4200.0, "command": "python benchmarks/step.py decode", "rows": [
    {"backend": "triton+graph", "batch": 1, "context": 2048, "ms": 4.5, "pipelined_ms": 4.24,
     "roofline_ms": 3.62, "x_roofline": 1.17},
    {"backend": "flashinfer+graph", "batch": 1, "context": 2048, "ms": 5.0, "pipelined_ms": 4.9,
     "roofline_ms": 3.62, "x_roofline": 1.35},
    {"backend": "triton+graph", "batch": 64, "context": 2048, "ms": 9.0, "pipelined_ms": 8.5,
     "roofline_ms": 7.62, "x_roofline": 1.115},
    {"backend": "flashinfer+graph", "error": "RuntimeError: boom"},
]}  # fmt: skip


def run(key: str, shape: str, seconds: float, tokens: int, **extra: object) -> dict[str, object]:
    return {"key": key, "shape": shape, "seconds": seconds, "error": None,
            "output_tok_per_s": tokens / seconds, "ms_per_output_token": 1e3 * seconds / tokens,
            **extra}  # fmt: skip


OFFLINE = {**GPU, "copy_GBps": 4217.0, "command": "python benchmarks/offline.py offline",
           "results": [run("offline", "1000 × 1000/1000", 81.29, 1_000_000, steps={
               "decode": {"steps": 1998, "mean_ms": 28.6}, "extend": {"steps": 123,
                                                                    "mean_ms": 189.6}})]}  # fmt: skip
PREFIX = {**GPU, "copy_GBps": 4207.0, "command": "python benchmarks/offline.py prefix",
          "results": [run("prefix:on", "1024 × 2176/256", 16.28, 262_144),
                      run("prefix:off", "1024 × 2176/256", 75.51, 262_144)]}  # fmt: skip
CONSTRAINED = {**GPU, "command": "python benchmarks/offline.py constrained", "results": [
    run("constrained", "32 × 256/256", 1.0, 5000, mask_fill={"p99_us": 5.1}),
    run("unconstrained", "32 × 256/256", 0.97, 5000)]}  # fmt: skip


def test_the_suite_keeps_the_published_workloads() -> None:
    suite = headline.parts(flashinfer=True)
    assert list(suite) == ["copy", "decode", "offline", "prefix", "constrained", "fp8_decode",
                           "fp8_offline"]  # fmt: skip
    fp8_decode = " ".join(headline.command(suite["fp8_decode"], 300))
    assert fp8_decode.endswith("--backends triton+graph --variant bf16: --variant "
                               "fp8:quantization=fp8,kv_cache_dtype=fp8_e4m3")  # fmt: skip
    fp8_offline = " ".join(headline.command(suite["fp8_offline"], 330))
    assert "kv_cache_dtype=fp8_e4m3 --engine-arg quantization=fp8" in fp8_offline
    decode = " ".join(headline.command(suite["decode"], 260))
    assert decode == ("python benchmarks/step.py decode --batches 1 64 --context 2048 --reps 20 "
                      "--backends triton+graph flashinfer+graph")  # fmt: skip
    assert "flashinfer" not in " ".join(headline.parts(flashinfer=False)["decode"].argv)
    offline = " ".join(headline.command(suite["offline"], 330))
    assert offline.startswith("python benchmarks/offline.py offline --num-prompts 1000 --no-hf")
    assert "kv_cache_dtype=fp8_e4m3" in offline and "max_running_requests=512" in offline
    assert offline.endswith("--budget-s 255 --grace-s 45")  # inside the part's limit
    prefix = " ".join(headline.command(suite["prefix"], 420))
    assert "--groups 64 --group-size 16" in prefix and "cuda_graph_max_bs=1024" in prefix
    with pytest.raises(SystemExit):
        headline.parse_args(["--parts", "decode,nope"])


def test_rows_name_the_peer_or_ceiling_of_the_same_run() -> None:
    parts = {"decode": DECODE, "offline": OFFLINE, "prefix": PREFIX, "constrained": CONSTRAINED}
    rows = {r.figure: r for r in headline_report.rows_of(parts)}
    bs1 = rows["decode step, batch 1, 2048 context (triton+graph)"]
    assert bs1.value == "4.24 ms" and bs1.device == "H200" and bs1.date == "2026-12-05 (abc1234)"
    assert bs1.against.startswith("roofline 3.62 ms at 4,200 GB/s (1.17×); FlashInfer 4.90 ms")
    assert (
        "FlashInfer not installed"
        in rows["decode step, batch 64, 2048 context (triton+graph)"].against
    )
    assert rows["offline 1000 × 1000/1000 in/out"].value == "12,302 output tok/s"
    assert (
        "decode 1,998 × 28.6 ms, extend 123 × 189.6 ms"
        in rows["offline 1000 × 1000/1000 in/out"].against
    )
    prefix = rows["prefix sharing 1024 × 2176/256, radix cache on / off"]
    assert prefix.value == "4.64×" and "off 75.5 s" in prefix.against
    constrained = next(r for r in rows.values() if r.part == "constrained")
    assert constrained.value == "+3.1%" and "p99 5.1 µs" in constrained.against
    text = headline_report.markdown(list(rows.values()), parts)
    assert "| decode step, batch 1, 2048 context (triton+graph) | **4.24 ms** |" in text
    assert "- `prefix`: `python benchmarks/offline.py prefix`" in text


def test_merge_of_two_calls_writes_table_and_plot(tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"parts": {"decode": DECODE, "offline": OFFLINE}}))
    second.write_text(json.dumps({"parts": {"prefix": PREFIX}}))
    out = tmp_path / "out"
    assert headline.main(["--merge", str(first), str(second), "--out", str(out)]) == 0
    data = json.loads((out / "headline.json").read_text())
    assert sorted(data["parts"]) == ["decode", "offline", "prefix"]
    assert [r["part"] for r in data["rows"]] == ["decode", "decode", "offline", "prefix"]
    assert "4.64×" in (out / "headline.md").read_text()
    pytest.importorskip("matplotlib")
    assert (out / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_suite_on_cpu_with_tiny_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy part and a decode part on a tiny config: subprocesses, logs, results, rows."""
    bench_utils.write_config(tmp_path, num_hidden_layers=1, max_position_embeddings=256)
    tiny = {
        "copy": headline.Part("copy", ("kernel.py", "copy"), 120),
        "decode": headline.Part(
            "decode",
            (
                "step.py",
                "decode",
                "--config",
                str(tmp_path),
                "--backends",
                "torch",
                "--batches",
                "1",
                "--context",
                "16",
                "--reps",
                "2",
            ),
            300,
        ),  # fmt: skip
    }
    monkeypatch.setattr(headline, "parts", lambda flashinfer: tiny)
    out = tmp_path / "out"
    assert headline.main(["--parts", "copy,decode", "--out", str(out)]) == 0
    data = json.loads((out / "headline.json").read_text())
    assert data["parts"]["decode"]["command"].startswith("python benchmarks/step.py decode")
    assert [r["part"] for r in data["rows"]] == ["copy", "decode"]
    assert (out / "parts" / "decode.log").read_text()
