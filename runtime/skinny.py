"""Which projections of the smallest decode batches run weft's skinny GEMV instead of cuBLAS:
measured per weight shape and batch size on the model's own weights before graph capture."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from weft.runtime.graph_blas import blas_library
from weft.runtime.models.layers import Projection

# The GEMV is taken only where it saves at least this share of cuBLAS's time (timing noise)
MIN_GAIN = 0.03
Shape = tuple[int, int, bool]  # (out features, in features, gated)


def mode_from_env() -> str:
    """WEFT_GEMV: auto (measure per shape and batch size, the default), on (every size the GEMV
    serves) or off (cuBLAS only), for comparison."""
    mode = os.environ.get("WEFT_GEMV", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"WEFT_GEMV must be auto, on or off, got {mode!r}")
    return mode


def by_shape(model: nn.Module) -> dict[Shape, list[Projection]]:
    """The model's Projections grouped by (out, in, gated), in module order."""
    groups: dict[Shape, list[Projection]] = {}
    for m in model.modules():
        if isinstance(m, Projection):
            groups.setdefault((m.out_features, m.in_features, m.gated), []).append(m)
    return groups


def choose(
    model: nn.Module, sizes: Sequence[int], blas: dict[int, str], mode: str, reps: int = 5
) -> dict[Shape, list[int]]:
    """Set each Projection's gemv_sizes; returns them per shape. `blas`: the cuBLAS library each
    size's graph is captured with (the one the GEMV must beat)."""
    from weft.kernels.skinny import MAX_ROWS

    small = [s for s in sizes if s <= MAX_ROWS]
    picks: dict[Shape, list[int]] = {}
    for shape, mods in by_shape(model).items():
        if mode == "off" or not mods[0].weight.is_cuda:
            picks[shape] = []
        elif mode == "on":
            picks[shape] = list(small)
        else:
            picks[shape] = [
                size
                for size in small
                if _time_ms(mods, size, True, blas[size], reps)
                < (1 - MIN_GAIN) * _time_ms(mods, size, False, blas[size], reps)
            ]
        for m in mods:
            m.gemv_sizes = frozenset(picks[shape])
    return picks


@torch.no_grad()
def _time_ms(mods: list[Projection], size: int, gemv: bool, library: str, reps: int) -> float:
    """Median ms of one pass over all of `mods` (every layer's weight, so none stays in the L2
    for the next) at `size` rows: through the GEMV, or cuBLAS (`library`) as the model calls it."""
    from weft.kernels import gemv as run_gemv
    from weft.kernels import silu_and_mul

    m0 = mods[0]
    width = 2 * m0.in_features if m0.gated else m0.in_features
    x = torch.randn(size, width, dtype=m0.weight.dtype, device=m0.weight.device)

    def op(m: Projection) -> torch.Tensor:
        if gemv:
            return run_gemv(x, m.weight, m.bias, silu_mul=m.gated)
        # as the model calls cuBLAS: a gated projection's activation runs first, on its own
        return F.linear(silu_and_mul(x) if m.gated else x, m.weight, m.bias)

    times = []
    with blas_library(library):
        for rep in range(reps + 1):  # the first pass compiles and warms up
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for m in mods:
                op(m)
            end.record()
            end.synchronize()
            if rep:
                times.append(start.elapsed_time(end))
    return statistics.median(times)
