"""Shared by the CUDA kernel tests: the kernels by name, the references, tolerances and a paged
KV pool of random contents."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from support import kernel_names

from weft.kernels import reference as ref

wk = kernel_names("weft.kernels")
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
DEV = "cuda"
__all__ = ["DEV", "TOL", "assert_close", "random_pool", "ragged", "ref", "wk"]


def _kernel_util() -> ModuleType:
    """benchmarks/kernel_util.py, loaded by path (it builds the random paged pools)."""
    name = "bench_kernel_util"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_util.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def random_pool(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    """(k_buffer, v_buffer, req_to_token, req_rows): see the benchmark's random_pool."""
    return _kernel_util().random_pool(*args, **kwargs)  # type: ignore[no-any-return]


def assert_close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Every element written and finite; relative L2 error under tol."""
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten (NaN)"
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def ragged(n: int, lo: int, hi: int) -> list[int]:
    """n random lengths in [lo, hi], with both ends and a page boundary among them."""
    lens = torch.randint(lo, hi + 1, (n,)).tolist()
    lens[:3] = [lo, hi, max(lo, min(hi, 32))][: len(lens)]
    return lens
