"""benchmarks/ptx_loop.py on this machine (no GPU: Triton compiles for sm_90 with its own ptxas):
the fp8 decode's V tiles reach the dot without byte-wise shared-memory reads (the change the
H200 measured: BENCHMARKS.md, ninth session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not importable")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as top-level modules
import ptx_loop  # noqa: E402


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
