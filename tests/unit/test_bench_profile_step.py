"""benchmarks/profile_step.py's kernel timeline on a made-up trace: idle gaps, and what each
kernel adds to the step when kernels overlap (programmatic dependents)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import profile_step  # noqa: E402


def test_marginal_time_counts_overlap_once_and_gaps_as_idle() -> None:
    # norm 0-2, gemv 1-10 (started early: 8 us past the norm's end), attn 12-20 (a 2 us gap),
    # reduce 15-18 (inside attn: adds nothing); a second step the same, 100 us later
    step = [("norm", 0, 2), ("gemv", 1, 9), ("attn", 12, 8), ("reduce", 15, 3)]
    gpu = [{"name": n, "ts": t + off, "dur": d} for off in (0, 100) for n, t, d in step]
    lines = profile_step.timeline_report(gpu, steps=2)
    assert lines[0].startswith("per step: 4 kernels, 0.022 ms of kernel time, 0.002 ms idle")
    assert "2 kernels started before the one before ended" in lines[0]
    marginal = {ln.split()[-1]: float(ln.split()[0]) for ln in lines[lines.index(
        next(ln for ln in lines if ln.startswith("marginal"))) + 1 :]}  # fmt: skip
    assert marginal == {"gemv": 8.0, "attn": 8.0, "norm": 2.0, "reduce": 0.0}
    assert sum(marginal.values()) == 20 - 2  # the step's span less its idle gap
