"""Which cuBLAS path runs the projection GEMMs of each decode CUDA graph: torch's default or cuBLASLt's
heuristic, measured per batch size on the model's own weights before capture."""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

LIBRARIES = ("cublas", "cublaslt")
# cuBLASLt is taken only where it saves at least this share of the GEMMs' time: a smaller
# difference is within the timing's noise (H200: down at batch 64, 33.2 vs 37.4 us per layer;
# at batch 8 the other way, 36.1 vs 32.9: BENCHMARKS.md, fifteenth session)
MIN_GAIN = 0.02


def mode_from_env() -> str:
    """WEFT_GRAPH_BLAS: auto (measure per batch size, the default), cublas or cublaslt (every
    graph), for comparison."""
    mode = os.environ.get("WEFT_GRAPH_BLAS", "auto")
    if mode not in ("auto", *LIBRARIES):
        raise ValueError(f"WEFT_GRAPH_BLAS must be auto, cublas or cublaslt, got {mode!r}")
    return mode


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` inside the block (process-wide: used only
    while capturing, before the runner serves)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def choose(sizes: Sequence[int], time_ms: Callable[[str, int], float]) -> dict[int, str]:
    """Per batch size, the library whose GEMMs took least time (`time_ms(library, size)`),
    cuBLASLt only where it saves MIN_GAIN or more."""
    picks = {}
    for size in sizes:
        base, lt = (time_ms(lib, size) for lib in LIBRARIES)
        picks[size] = "cublaslt" if lt < (1 - MIN_GAIN) * base else "cublas"
    return picks


def projection_timer(
    model: nn.Module, max_batch: int, reps: int = 3
) -> Callable[[str, int], float]:
    """time_ms(library, batch <= max_batch) for the model's projection GEMMs (every nn.Linear,
    in module order, on its own weights, so no layer's weights stay in the L2 for the next):
    the median of `reps` passes over all of them, after one warm-up pass."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs: dict[int, torch.Tensor] = {}  # per input width: max_batch random rows

    def time_ms(library: str, batch: int) -> float:
        assert batch <= max_batch, (batch, max_batch)
        if not linears:
            return 0.0
        w = linears[0].weight
        for m in linears:
            if m.in_features not in inputs:
                x = torch.randn(max_batch, m.in_features, dtype=w.dtype, device=w.device)
                inputs[m.in_features] = x
        xs = [inputs[m.in_features][:batch] for m in linears]
        times = []
        with torch.no_grad(), blas_library(library):
            for rep in range(reps + 1):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for m, x in zip(linears, xs, strict=True):
                    F.linear(x, m.weight, m.bias)
                end.record()
                end.synchronize()
                if rep:
                    times.append(start.elapsed_time(end))
        return statistics.median(times)

    return time_ms
