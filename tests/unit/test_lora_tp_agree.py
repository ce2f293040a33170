"""LoRA adapters loaded while serving with tensor parallelism (two gloo ranks, two processes): a
folder that one rank cannot read fails the load on every rank, with that rank's reason, so the
ranks never disagree on the adapters they serve; one every rank reads is served by all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lora_helpers import ADAPTERS, build_lora_setup

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

WORKER = Path(__file__).with_name("lora_tp_worker.py")


def test_ranks_agree_on_a_load_that_fails_on_one_of_them(tmp_path: Path) -> None:
    base, folders, _ = build_lora_setup(tmp_path, {"attn": ADAPTERS["attn"]})
    good = folders["attn"]
    broken = tmp_path / "truncated"  # as one rank would see a file it cannot read in full
    broken.mkdir()
    weights = (good / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    (broken / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
    cases = {  # adapter name -> the folder each rank reads
        "rank1_fails": [str(good), str(broken)],
        "rank0_fails": [str(broken), str(good)],
        "both_read": [str(good), str(good)],
    }
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-P", str(WORKER), "", "2", init, str(base), json.dumps(cases)]
    procs = [
        subprocess.Popen([*argv[:3], str(rank), *argv[4:], str(tmp_path)], env=env)
        for rank in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    rank0, rank1 = (json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2))
    unreadable = "not a readable safetensors file"
    # rank 0 (the one that replies) read it, but rank 1 could not: nobody serves it
    assert "tensor-parallel rank 1 could not read it" in rank0["rank1_fails"]["error"]
    assert unreadable in rank0["rank1_fails"]["error"]
    assert unreadable in rank1["rank1_fails"]["error"]
    # rank 0 could not: its own reason, as with one rank
    assert rank0["rank0_fails"]["error"].startswith(str(broken))
    assert "tensor-parallel rank 0 could not read it" in rank1["rank0_fails"]["error"]
    for served in (rank0, rank1):
        assert served["rank1_fails"]["served"] == served["rank0_fails"]["served"] == []
        assert served["both_read"] == {"error": None, "served": ["both_read"]}
