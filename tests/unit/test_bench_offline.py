"""benchmarks/offline.py on CPU: the synthetic tokenizer, the engine plan, the ratios, and every mode
end to end at tiny scale on a random 2-layer config (two engines: radix cache on, then off)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from weft.runtime.loader.synthetic_tokenizer import has_tokenizer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules

import bench_utils  # noqa: E402
import offline_jobs  # noqa: E402
import offline_plan  # noqa: E402
import offline_report  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_offline", BENCH / "offline.py")
assert _spec is not None and _spec.loader is not None
bo = importlib.util.module_from_spec(_spec)
sys.modules["bench_offline"] = bo
_spec.loader.exec_module(bo)

TINY_CONFIG = {**bench_utils.TINY_LLAMA, "vocab_size": 700, "eos_token_id": [2, 699]}
TINY_ARGS = [
    *("--num-prompts", "6", "--input-len", "12", "--output-len", "6"),
    *("--hf-num-prompts", "4", "--hf-batch", "2"),
    *("--groups", "2", "--group-size", "3", "--prefix-len", "24", "--question-len", "4"),
    *("--prefix-output-len", "5", "--noshare-prompts", "3"),
    *("--constrained-batch", "3", "--constrained-input-len", "6"),
    *("--constrained-max-tokens", "20"),
    *("--ablation-prompts", "3", "--ablation-input-len", "8", "--ablation-output-len", "4"),
    # a variant that the prefix mode's radix-cache-off engine already is: no third engine start
    *("--variant", "cache off:disable_radix_cache=true"),
    # one 28-token prompt per prefill batch: later requests of a group always find the prefix
    *("--engine-arg", "max_prefill_tokens=28"),
]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-config")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder


##### Pieces #####


def test_model_folder_adds_a_tokenizer_only_when_missing(tiny_config: Path, tmp_path: Path) -> None:
    folder, note = bench_utils.model_folder(str(tiny_config), tmp_path)
    assert folder != tiny_config and "synthetic" in note
    assert has_tokenizer(folder)
    same, note = bench_utils.model_folder(str(folder), tmp_path / "again")
    assert same == folder and "own" in note


def plan_for(argv: list[str], device: str = "cpu") -> tuple[argparse.Namespace, offline_plan.Plan]:
    args = bo.parse_args([*argv, "--model", "unused"])
    args.folder = "unused"
    return args, offline_plan.build_plan(args, device, TINY_CONFIG)


def test_plan_shares_engines_and_skips_what_cannot_run_here() -> None:
    args, plan = plan_for(["all", *TINY_ARGS])
    labels = [s.label for s in plan.engines.values()]
    assert labels == ["torch", "torch, radix cache off"]
    base, off = plan.engines.values()
    assert [k for _, k, _ in base.jobs] == [
        *("offline", "prefix:on", "noshare:on", "constrained", "ablation:base"),
    ]
    assert [k for _, k, _ in off.jobs] == [
        "prefix:off",
        "noshare:off",
        "ablation:torch, radix cache off",
    ]
    skipped = {r.label: r.error for r in plan.skipped}
    assert "CUDA graphs do not apply" in skipped["CUDA graphs off"]
    assert "needs a CUDA device" in skipped["triton"] and "flashinfer" in skipped
    assert base.kwargs["context_length"] == 64  # 24 + 4 + 5 (+ 16), rounded up to 64
    assert base.kwargs["load_format"] == "dummy" and base.kwargs["max_prefill_tokens"] == 28


def test_plan_labels_on_cuda_dedupe_graphs_off_and_triton() -> None:
    plan = offline_plan.Plan("cuda", {"model": "m"})
    assert plan.label(plan.base) == "triton, CUDA graphs"
    graphs_off = plan.key({"model": "m", "disable_cuda_graph": True})
    triton = plan.key({"model": "m", "attention_backend": "triton", "disable_cuda_graph": True})
    assert graphs_off == triton
    assert plan.label({"model": "m", "schedule_policy": "lpm"}) == (
        "triton, CUDA graphs, schedule_policy=lpm"
    )


def test_all_mode_scales_down_and_says_so() -> None:
    args = bo.parse_args(["all"])
    assert (args.num_prompts, args.groups, args.noshare_prompts) == (500, 16, 64)
    assert any("1000 → 500" in s for s in args.scaled)
    args = bo.parse_args(["offline", "--num-prompts", "7"])
    assert args.num_prompts == 7 and args.groups == 64 and args.scaled == []
    assert bo.parse_args([]).mode == "chat" and bo.parse_args([]).num_prompts == 16
    assert bo.parse_args(["programs"]).num_prompts == 16
    assert bench_utils.parse_kv(["a=true", "b=3", "c=lpm"]) == {"a": True, "b": 3, "c": "lpm"}


def test_tuning_variants_label_their_fields() -> None:
    plan = offline_plan.Plan("cuda", {"model": "m", "tuning": {"graph_blas": "cublas"}})
    over = bench_utils.merge_kwargs(plan.base, {"tuning": {"gemv": "off"}})
    assert over["tuning"] == {"graph_blas": "cublas", "gemv": "off"}
    assert plan.label(over) == "triton, CUDA graphs, tuning.gemv=off"
    assert plan.key(over) != plan.key(plan.base)


def test_shared_prefix_workload_shape() -> None:
    w = offline_jobs.shared_prefix_workload(3, 4, 10, 2, 5, vocab=100, seed=0)
    assert w.num_prompts == 12 and w.shape == "12 × 12/5"
    assert w.input_ids[0][:10] == w.input_ids[3][:10] != w.input_ids[4][:10]
    assert w.input_ids[0][10:] != w.input_ids[1][10:]
    assert all(3 <= t < 100 for ids in w.input_ids for t in ids)


def result(key: str, tokens: int, seconds: float, engine: str = "e") -> offline_jobs.RunResult:
    r = offline_jobs.RunResult("s", key, key, engine, "1 × 1/1")
    r.output_tokens, r.seconds = tokens, seconds
    return r


def test_headline_ratios() -> None:
    rows = offline_report.headline(
        [
            result("offline", 1000, 1.0),
            result("hf", 100, 1.0),
            result("prefix:on", 100, 1.0),
            result("prefix:off", 100, 4.0),
            result("noshare:on", 100, 1.0),
            result("noshare:off", 100, 1.0),
            result("constrained", 100, 1.03),
            result("unconstrained", 100, 1.0),
            result("ablation:base", 100, 1.0, "triton, CUDA graphs"),
            result("ablation:triton, eager", 100, 2.0, "triton, eager"),
            result("ablation:flashinfer, eager", 100, 1.0, "flashinfer, eager"),
        ]
    )
    values = {metric.split(",")[0]: value for metric, value, _ in rows}
    assert len(values) == len(rows), "two metrics share a name before the first comma"
    assert values["offline output tok/s"] == "1,000"
    assert values["weft / HF transformers"] == "10.00×"
    assert values["shared prefixes: radix cache on / off"] == "4.00×"
    assert values["no shared prefix: radix cache on / off"] == "1.000"
    assert values["JSON schema vs unconstrained"].startswith("+3.0%")
    assert len(rows) == 8  # no decode step times given: no decode-only row
    assert values["ablation: [triton"] == "0.50"
    assert values["FlashInfer / Triton (both eager)"] == "2.00"


def test_headline_constrained_decode_steps_alone() -> None:
    """With the scheduler's step times, a second row compares the decode steps alone."""
    con, free = result("constrained", 100, 1.2), result("unconstrained", 100, 1.0)
    con.extra["steps"] = {"decode": {"steps": 99, "total_s": 0.505}}
    free.extra["steps"] = {"decode": {"steps": 99, "total_s": 0.5}}
    rows = offline_report.headline([con, free])
    assert [r[1][:6] for r in rows] == ["+20.0%", "+1.0% "]
    assert "decode steps' time per output token" in rows[1][0]


def test_timeline_splits_the_run_outside_the_busy_periods() -> None:
    """Idle before the first launch, after the last period and between periods; periods of
    other runs (before start, after end) left out."""
    after = {"busy_periods": [[1.0, 2.0], [10.5, 11.0], [11.25, 12.0], [20.0, 21.0]]}
    got = offline_jobs.timeline(after, 10.0, 12.5)
    assert got == {"before_first_step_s": 0.5, "after_last_step_s": 0.5,
                   "idle_between_s": 0.25, "busy_periods": 2}  # fmt: skip
    assert offline_jobs.timeline({"busy_periods": [[1.0, 2.0]]}, 10.0, 12.5) == {}
    steps = {"retractions": 0, "extend": {"steps": 1, "mean_ms": 5.0},
             "decode": {"steps": 0, "mean_ms": None}, **got}  # fmt: skip
    text = offline_report.steps_text(steps)
    assert text.endswith(
        "idle 0.50 s before the first step, 0.50 s after the last, 0.25 s between 2 busy periods"
    )


##### End to end #####


def test_every_mode_tiny_on_cpu(tiny_config: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    argv = ["all", "--model", str(tiny_config), *TINY_ARGS, "--output-file", str(out)]
    assert bo.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["copy_GBps"] > 0 and report["command"].startswith("python benchmarks/offline.py")
    runs = {r["key"]: r for r in report["results"]}
    ran = ["offline", "hf", "prefix:on", "prefix:off", "noshare:on", "noshare:off"]
    ran += ["constrained", "unconstrained", "ablation:base", "ablation:torch, radix cache off"]
    for key in ran:
        assert runs[key]["error"] is None, runs[key]
        assert runs[key]["output_tok_per_s"] > 0 and math.isfinite(runs[key]["output_tok_per_s"])
    assert runs["offline"]["output_tokens"] == 6 * 6
    timeline = runs["offline"]["steps"]  # the scheduler's idle time is placed
    assert timeline["busy_periods"] >= 1 and timeline["before_first_step_s"] >= 0
    assert 0 < runs["offline"]["kv"]["mean"] <= 1 and "KV held" in report["markdown"]
    assert "s before the first step" in report["markdown"]
    assert runs["hf"]["output_tokens"] == 4 * 6 and runs["hf"]["num_prompts"] == 4
    assert 24 <= runs["prefix:on"]["cached_tokens"] <= 2 * 2 * 24  # later requests of a group hit
    assert runs["prefix:off"]["cached_tokens"] == 0
    lengths = runs["constrained"]["output_lengths"]
    assert runs["unconstrained"]["output_tokens"] == sum(lengths) > 0
    assert runs["ablation:CUDA graphs off"]["error"].startswith("skipped")
    md = report["markdown"]
    for text in (report["date"], "GB/s", report["command"], "weft / HF", "radix cache on / off"):
        assert text in md
    assert "JSON schema vs unconstrained" in md and "| engine | start s |" in md


def test_lora_mode_tiny_on_cpu(tiny_config: Path, tmp_path: Path, monkeypatch) -> None:
    """The lora mode: the base model, then 1 and 3 random adapters mixed in one workload (PEFT
    folders written for the config, the copies hard links), each engine's output counted."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    argv = ["lora", "--model", str(tiny_config), "--lora-prompts", "5", "--input-len", "8",
            "--output-len", "4", "--lora-adapters", "1", "3", "--lora-rank", "4",
            "--output-file", str(out)]  # fmt: skip
    assert bo.main(argv) == 0
    report = json.loads(out.read_text())
    runs = {r["key"]: r for r in report["results"]}
    assert set(runs) == {"lora:base", "lora:1", "lora:3"}
    for run in runs.values():
        assert run["error"] is None and run["output_tokens"] == 5 * 4, run
    assert runs["lora:3"]["label"] == "lora, 3 adapters"
    assert runs["lora:3"]["engine"] == "torch, 3 LoRA adapters, max_lora_rank=4"
    assert "LoRA, 3 adapters mixed / base model" in report["markdown"]


def test_adapter_folders_load_as_weft_reads_them(tmp_path: Path) -> None:
    import offline_lora

    from weft.runtime.lora import LoraShapes, load_adapter

    entries = offline_lora.adapter_folders(TINY_CONFIG, 4, 2, tmp_path)
    assert [e.partition("=")[0] for e in entries] == ["lora0", "lora1"]
    shapes = LoraShapes.from_hf_config(SimpleNamespace(**TINY_CONFIG))
    for entry in entries:
        adapter = load_adapter("x", entry.partition("=")[2], shapes, 4)
        assert adapter.rank == 4 and all(len(layer) == 4 for layer in adapter.layers)
    first, second = (tmp_path / f"lora{i}" / "adapter_model.safetensors" for i in (0, 1))
    assert first.stat().st_ino == second.stat().st_ino  # a hard link, not a second write
