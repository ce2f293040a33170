"""benchmarks/spec.py: variants and arguments, the workloads' prompts, the comparison and table, and
a tiny run of plain against n-gram speculation on the tiny model (CPU); benchmarks/spec_replay.py:
a recorded trace replayed on random weights takes the recorded steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import spec  # noqa: E402
import spec_replay  # noqa: E402
import spec_report  # noqa: E402
import spec_workloads  # noqa: E402


class NoTemplate:
    chat_template = None


def test_variants_and_arguments() -> None:
    args = spec.parse_args([])
    assert [n for n, _ in args.variants] == ["plain", "ngram"]
    assert args.variants[1][1] == {"speculative_algorithm": "ngram"}
    assert args.batches == [1] and args.workloads == ["code-edit", "sharegpt", "json"]
    draft = "draft:speculative_algorithm=draft,speculative_draft_model_path=/m/d.gguf,page_size=4"
    args = spec.parse_args(["--variant", "off:", "--variant", draft, "--batches", "1", "8",
                            "--engine-arg", "load_format=dummy"])  # fmt: skip
    assert args.variants == [("off", {}), ("draft", {
        "speculative_algorithm": "draft", "speculative_draft_model_path": "/m/d.gguf",
        "page_size": 4})]  # fmt: skip
    assert [spec.is_speculative(kw) for _, kw in args.variants] == [False, True]
    assert spec.notes(args) == [spec.DUMMY_NOTE]
    for bad in (["--variant", "nocolon"], ["--variant", ":x=1"], ["--variant", "a:x"],
                ["--variant", "a:", "--variant", "a:x=1"], ["--batches", "0"],
                ["--snippet-lines", "9", "3"]):  # fmt: skip
        with pytest.raises(SystemExit):
            spec.parse_args(bad)


def test_workloads(tmp_path: Path) -> None:
    code = spec_workloads.code_edit_prompts(16, (20, 60), seed=0)
    assert len(set(code)) == 16
    lines = [p.split("```python\n")[1].split("\n```")[0].count("\n") + 1 for p in code]
    assert all(20 <= n <= 60 for n in lines) and len(set(lines)) > 4
    assert code == spec_workloads.code_edit_prompts(16, (20, 60), seed=0)
    turns = [{"conversations": []},
             {"conversations": [{"from": "human", "value": "short"}]},
             {"conversations": [{"from": "gpt", "value": "x" * 50},
                                {"from": "human", "value": "Explain rust lifetimes, please."}]},
             {"conversations": [{"from": "human", "value": "What is a monad, in short?"}]}]  # fmt: skip
    path = tmp_path / "sg.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in turns))
    ws = spec_workloads.WorkloadSpec(num_prompts=2, max_new_tokens=7, sharegpt=path)
    sg = spec_workloads.build_workload("sharegpt", NoTemplate(), ws)
    assert sg.prompts == ["User: Explain rust lifetimes, please.\nAssistant:",
                          "User: What is a monad, in short?\nAssistant:"]  # fmt: skip
    with pytest.raises(ValueError, match="only 2 prompts"):
        spec_workloads.build_workload("sharegpt", NoTemplate(), ws.__class__(3, 7, sharegpt=path))
    with pytest.raises(FileNotFoundError, match="--sharegpt"):
        spec_workloads.build_workload("sharegpt", NoTemplate(), ws.__class__(2, 7))
    js = spec_workloads.build_workload("json", NoTemplate(), ws)
    assert json.loads(js.params["json_schema"])["required"][0] == "name"
    assert js.params["temperature"] == 0 and js.params["max_new_tokens"] == 7
    with pytest.raises(ValueError, match="3 prompts wanted"):
        js.take(3)


def test_compare_and_table() -> None:
    Row = spec_report.Row
    base = Row("code-edit", 1, "plain", False, requests=2, output_tokens=100, wall_s=10.0,
               decode_steps=98, step_us=9_800_000, output_ids=[[1, 2], [3, 4]])  # fmt: skip
    ngram = Row("code-edit", 1, "ngram", True, requests=2, output_tokens=100, wall_s=5.0,
                decode_steps=10, verify_steps=30, step_us=4_000_000, spec_verify_ct=30,
                spec_draft_tokens=80, spec_accepted_tokens=60, output_ids=[[1, 2], [3, 5]])  # fmt: skip
    lone = Row("json", 8, "ngram", True, error="engine failed: ValueError: boom")
    rows = [base, ngram, lone]
    spec_report.compare(rows, "plain")
    assert ngram.speedup == pytest.approx(2.0) and ngram.identical == 1
    assert base.speedup == pytest.approx(1.0) and base.identical == 2
    assert lone.speedup is None and lone.identical is None
    assert ngram.acceptance == pytest.approx(0.75) and ngram.accept_length == pytest.approx(3.0)
    assert ngram.step_ms == pytest.approx(100.0) and base.acceptance is None
    d = ngram.to_dict()
    assert d["output_lengths"] == [2, 2] and "output_ids" not in d and d["tok_s"] == 20.0
    text = spec_report.table(rows)
    assert "| code-edit | 1 | ngram | 2 | 100 | 20.0 | 2.00× | 75.0% | 3.00 | 1/2 | 10 + 30 |" \
        in text  # fmt: skip
    assert "| json | 8 | ngram | engine failed: ValueError: boom |" in text


def test_tiny_run_plain_against_ngram(tiny_model_dir: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    sg = tmp_path / "sg.jsonl"
    sg.write_text(json.dumps({"conversations": [{"from": "human", "value": "Say hi " * 4}]}) + "\n"
                  + json.dumps({"conversations": [{"from": "human", "value": "Count from one to five, slowly."}]}))  # fmt: skip
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dir), "--workloads", "code-edit", "sharegpt",
            "--batches", "1", "2", "--num-prompts", "2", "--max-new-tokens", "6",
            "--snippet-lines", "4", "6", "--sharegpt", str(sg), "--no-warmup",
            "--engine-arg", "cpu_threads=1", "--out", str(out)]  # fmt: skip
    assert spec.main(argv) == 0
    data = json.loads((out / "spec.json").read_text())
    assert data["command"] == "python benchmarks/spec.py " + " ".join(argv)
    rows = data["rows"]
    assert [(r["workload"], r["batch"], r["variant"]) for r in rows] == [
        (w, b, v) for v in ("plain", "ngram") for w in ("code-edit", "sharegpt") for b in (1, 2)
    ]
    for r in rows:
        assert r["requests"] == 2 and r["tok_s"] > 0 and r["output_tokens"] > 0
        assert r["identical"] == 2  # greedy speculation gives the plain outputs
    assert sum(r["spec_draft_tokens"] for r in rows if r["variant"] == "ngram") > 0
    assert all(r["spec_draft_tokens"] == 0 for r in rows if r["variant"] == "plain")
    md = (out / "spec.md").read_text()
    assert "| sharegpt | 2 | ngram | 2 |" in md and md.strip() in capsys.readouterr().out


def test_replay_arguments() -> None:
    args = spec_replay.parse_args(["record", "--model", "m", "--trace", "t.json",
                                   "--variant", "ng:speculative_algorithm=ngram"])  # fmt: skip
    assert args.variants == [("ng", {"speculative_algorithm": "ngram"})]
    for bad in (["--variant", "plain:speculative_algorithm=ngram"], ["--variant", "x:"],
                ["--variant", "nocolon"], []):  # fmt: skip
        with pytest.raises(SystemExit):
            spec_replay.parse_args(["record", "--model", "m", "--trace", "t.json", *bad])


def test_replay_runs_the_workloads_asked_for(tmp_path: Path) -> None:
    """--workloads picks the trace's requests to replay; one the trace lacks is named."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"variants": {}, "requests": [
        {"workload": "code-edit", "input_ids": [1, 2], "output_len": 3, "steps": {}},
    ]}))  # fmt: skip
    with pytest.raises(SystemExit, match="has no sharegpt requests; it has code-edit"):
        spec_replay.main(["replay", "--model", "m", "--trace", str(trace),
                          "--workloads", "code-edit", "sharegpt"])  # fmt: skip


def test_replay_takes_the_recorded_steps(tiny_model_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """record on the tiny model (n-gram drafts from code-edit prompts), then replay on random
    weights of the same config with every step verifying as in record: each request takes the
    recorded verify steps (positions, drafts, accepted) and its recorded output length, at
    batch sizes 1 and 2."""
    from weft.runtime.scheduler.spec_costs import StepCosts

    trace, out = tmp_path / "trace.json", tmp_path / "rec.json"
    argv = ["record", "--model", str(tiny_model_dir), "--workloads", "code-edit",
            "--num-prompts", "2", "--max-new-tokens", "16", "--engine-arg", "cpu_threads=1",
            "--snippet-lines", "6", "10",
            "--variant", "ngram:speculative_algorithm=ngram", "--trace", str(trace),
            "--out", str(out)]  # fmt: skip
    assert spec_replay.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["same_as_baseline"]) for r in rows] == [("plain", None), ("ngram", 2)]
    doc = json.loads(trace.read_text())
    steps = [[tuple(s) for s in r["steps"]["ngram"]] for r in doc["requests"]]
    assert sum(d for st in steps for _, d, _ in st) > 0, steps
    monkeypatch.setattr(StepCosts, "speculate", lambda self, batch_size: True)
    work = {"code-edit": [spec_replay.TraceReq("code-edit", r["input_ids"], r["output_len"],
                                               {"ngram": st})
                          for r, st in zip(doc["requests"], steps, strict=True)]}  # fmt: skip
    kw = {"load_format": "dummy", "skip_tokenizer_init": True, "cpu_threads": 1,
          "speculative_algorithm": "ngram"}  # fmt: skip
    got, outs, seen = spec_replay.run_variant(str(tiny_model_dir), "ngram", kw, work, [1, 2], True)
    for b in (1, 2):
        for j, r in enumerate(doc["requests"]):
            assert seen[f"code-edit/{b}/{j}"] == steps[j], (b, j)
            assert len(outs[f"code-edit/{b}/{j}"]) == r["output_len"]
    assert got[0].accepted == got[1].accepted == sum(a for st in steps for _, _, a in st)
