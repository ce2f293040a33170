"""benchmarks/ptx_loop.py on this machine (no GPU: Triton compiles for sm_90 with its own ptxas):
the fp8 decode's V tiles reach the dot without byte-wise shared-memory reads, as on the H200."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not importable")
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ptx_loop.py"
_spec = importlib.util.spec_from_file_location("bench_ptx_loop", _PATH)
assert _spec is not None and _spec.loader is not None
ptx_loop = importlib.util.module_from_spec(_spec)
sys.modules["bench_ptx_loop"] = ptx_loop
_spec.loader.exec_module(ptx_loop)


def _byte_loads(staged: bool) -> tuple[int, int]:
    kernel = ptx_loop.compile_split_kernel(True, staged, 128, 4, 3)
    body = ptx_loop.loop_body(kernel.asm["ptx"])
    converts = sum(s.startswith("cvt.rn.f16x2.e4m3x2") for s in body)
    return sum(s.startswith("ld.shared.b8") for s in body), converts


@pytest.mark.skipif(
    not (Path(ptx_loop.triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
    reason="this triton ships no ptxas",
)
def test_fp8_v_staged_reads_no_single_bytes_from_shared_memory() -> None:
    sunk_bytes, sunk_converts = _byte_loads(staged=False)
    staged_bytes, staged_converts = _byte_loads(staged=True)
    assert sunk_bytes >= 64, sunk_bytes  # the old path: V gathered byte by byte
    assert staged_bytes == 0
    assert staged_converts == sunk_converts == 128  # both convert each K and V value once
