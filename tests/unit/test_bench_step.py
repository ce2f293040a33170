"""benchmarks/step.py: the roofline arithmetic, engine arguments and variants, the kernel timeline
on a made-up trace, and a decode run on CPU with a tiny config (what the GPU run does, smaller)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import bench_utils  # noqa: E402
import step  # noqa: E402
import step_profile  # noqa: E402


def test_roofline_of_llama_8b_at_batch_1() -> None:
    # Llama-3.1-8B: 8.03 B parameters in bf16, of which the 128256 x 4096 input embedding; a
    # decode step reads one row of it, and 128 KiB of bf16 KV per token of context
    params, embed, row = 16_060_522_496, 128256 * 4096 * 2, 4096 * 2
    weights = step.step_weight_bytes(params, embed, row, 1, tied=False)
    assert weights == params - embed + row
    assert step.step_weight_bytes(params, embed, row, 1, tied=True) == params
    kv = 32 * 8 * 128 * 2 * 2
    seconds = step.decode_roofline_s(weights, kv, 1, 2048, bandwidth=4.2e12)
    assert seconds == pytest.approx((weights + 2049 * kv) / 4.2e12)
    assert 3.6e-3 < seconds < 3.7e-3  # the H200's batch-1 roofline in BENCHMARKS.md
    at_64 = step.decode_roofline_s(step.step_weight_bytes(params, embed, row, 64, False), kv,
                                   64, 2048, 4.2e12)  # fmt: skip
    assert 7.5e-3 < at_64 < 7.7e-3


def test_engine_args_nest_tuning_fields_and_merge_them() -> None:
    kw = bench_utils.parse_kv(["tuning.gemv=off", "tuning.disable_pdl=true", "page_size=16"])
    assert kw == {"tuning": {"gemv": "off", "disable_pdl": True}, "page_size": 16}
    merged = bench_utils.merge_kwargs(kw, {"tuning": {"gemv": "on"}, "page_size": 1})
    assert merged == {"tuning": {"gemv": "on", "disable_pdl": True}, "page_size": 1}
    for bad in (["gemv"], ["=3"], ["page_size=1", "page_size.x=2"]):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE|set as a value"):
            bench_utils.parse_kv(bad)


def test_variants_run_in_turn() -> None:
    args = step.parse_args(["decode", "--variant", "off:tuning.gemv=off", "--variant", "on:",
                            "--rounds", "2", "--engine-arg", "tuning.graph_blas=cublas"])  # fmt: skip
    names = [(n, kw) for n, kw in step.variants(args)]
    assert names == [("off", {"tuning": {"gemv": "off"}}), ("on", {})] * 2
    assert args.engine_arg == {"tuning": {"graph_blas": "cublas"}}
    kwargs = step.engine_kwargs("flashinfer+graph", args, cuda_graph_max_bs=8)
    assert kwargs["attention_backend"] == "flashinfer" and not kwargs["disable_cuda_graph"]
    assert kwargs["tuning"] == {"graph_blas": "cublas"} and kwargs["cuda_graph_max_bs"] == 8
    assert step.variants(step.parse_args(["decode"])) == [("default", {})]


def test_marginal_time_counts_overlap_once_and_gaps_as_idle() -> None:
    # norm 0-2, gemv 1-10 (started early: 8 us past the norm's end), attn 12-20 (a 2 us gap),
    # reduce 15-18 (inside attn: adds nothing); a second step the same, 100 us later
    steps = [("norm", 0, 2), ("gemv", 1, 9), ("attn", 12, 8), ("reduce", 15, 3)]
    gpu = [{"name": n, "ts": t + off, "dur": d} for off in (0, 100) for n, t, d in steps]
    lines = step_profile.timeline_report(gpu, steps=2)
    assert lines[0].startswith("per step: 4 kernels, 0.022 ms of kernel time, 0.002 ms idle")
    assert "2 kernels started before the one before ended" in lines[0]
    marginal = {ln.split()[-1]: float(ln.split()[0]) for ln in lines[lines.index(
        next(ln for ln in lines if ln.startswith("marginal"))) + 1 :]}  # fmt: skip
    assert marginal == {"gemv": 8.0, "attn": 8.0, "norm": 2.0, "reduce": 0.0}
    assert sum(marginal.values()) == 20 - 2  # the step's span less its idle gap


def test_decode_on_cpu_writes_rows_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_utils.write_config(tmp_path, hidden_size=32, intermediate_size=64, head_dim=8)
    out = tmp_path / "step.json"
    argv = ["decode", "--config", str(tmp_path), "--backends", "torch", "--batches", "1", "3",
            "--context", "20", "--reps", "2", "--output-file", str(out)]  # fmt: skip
    assert step.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "python benchmarks/step.py " + " ".join(argv)
    rows = data["rows"]
    assert [(r["backend"], r["batch"], r["context"]) for r in rows] == [
        ("torch", 1, 20), ("torch", 3, 20)]  # fmt: skip
    assert all(r["roofline_ms"] > 0 and r["x_roofline"] > 0 for r in rows)
    assert rows[1]["roofline_ms"] > rows[0]["roofline_ms"]  # more KV and embedding rows
    assert "| torch | 3 × 20 |" in capsys.readouterr().out


def test_lora_variant_runs_a_mixed_adapter_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench_utils.write_config(tmp_path, hidden_size=32, intermediate_size=64, head_dim=8)
    lora = "lora x3:enable_lora=true,max_lora_rank=4,max_loras_per_batch=3"
    argv = ["decode", "--config", str(tmp_path), "--backends", "torch", "--batches", "4",
            "--context", "12", "--reps", "2", "--variant", "base:", "--variant", lora]  # fmt: skip
    assert step.main(argv) == 0
    table = capsys.readouterr().out
    assert "| torch base | 4 × 12 |" in table and "| torch lora x3 | 4 × 12 |" in table
    # the adapters the variant made, each resident, and the batch spread over all of them
    args = step.parse_args(argv)
    kwargs = step.merge_kwargs(step.engine_kwargs("torch", args, max_total_tokens=256,
                                                  context_length=64), step.variants(args)[1][1])  # fmt: skip
    runner = step.build_runner(kwargs)
    names = step.random_adapters(runner)
    assert names == ["random-0", "random-1", "random-2"]
    batch = step.spread_adapters(step_profile.decode_batch(runner, 4, 12, 128), names)
    assert [r.lora_path for r in batch.reqs] == [*names, names[0]]
    assert runner.lora is not None and runner.lora.pool.pinned() == dict.fromkeys(names, 1)
    state = runner.lora.forward_state(batch, 4)
    assert state is not None and sorted(set(state.token_slots.tolist())) == [0, 1, 2]
    assert step.random_adapters(step.build_runner(step.engine_kwargs("torch", args))) == []


def test_a_forced_lora_launch_holds_inside_only_and_refuses_bad_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from offline_lora import forced_lora_launch

    from weft.kernels import lora as lora_kernels

    default = lora_kernels.default_launch
    with forced_lora_launch("128/1/8/2"):
        got = lora_kernels.default_launch(64, 4096, 16)
        want = default(64, 4096, 16)
        assert (got.block_n, got.n_iters, got.num_warps) == (128, 1, 8)
        assert (got.split_k, got.block_k) == (max(1, want.split_k // 2), want.block_k)
        assert lora_kernels.default_launch(2048, 4096, 64) == default(2048, 4096, 64)  # prefill
    assert lora_kernels.default_launch is default
    for bad in ("64/1", "64/1/4/0", "64/x/4", "64/1/4/1/1", "48/1/4"):
        with pytest.raises(ValueError), forced_lora_launch(bad):
            pass
        assert lora_kernels.default_launch is default
    # in a step variant it is no engine argument (on CPU the LoRA kernels do not run)
    bench_utils.write_config(tmp_path, hidden_size=32, intermediate_size=64, head_dim=8)
    lora = "lora:enable_lora=true,max_lora_rank=4,max_loras_per_batch=2,lora_launch=64/1/4"
    argv = ["decode", "--config", str(tmp_path), "--backends", "torch", "--batches", "2",
            "--context", "12", "--reps", "2", "--variant", lora]  # fmt: skip
    assert step.main(argv) == 0
    assert "| torch lora | 2 × 12 |" in capsys.readouterr().out
