"""benchmarks/decode_vt.py's walks (the runtime's fp8 walk and the per-page V^T experiment) give the
float32 reference under TRITON_INTERPRET=1, NaN-poisoned pools included: run in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not importable: the kernels cannot run")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_walk_matches_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "decode_vt.py", "--check"],
        cwd=BENCH, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "relative error" in ln]
    assert len(lines) == 5, proc.stdout  # 3 walks on a finite pool, 2 on a poisoned one
