"""What each decode CUDA graph's projections run on, chosen on the model's own weights before
capture: the cuBLAS path of its GEMMs (torch's default or cuBLASLt's heuristic) and, for the
smallest batches, weft's skinny GEMV with each weight shape's fastest launch (the graph runner
then keeps, per batch size, the faster whole step: runtime/executor/cuda_graph.py)."""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.runtime.models.layers import GemvPlan, Projection, Shape

logger = logging.getLogger(__name__)
# GemvLaunch fields (block_n, block_k, split_k, num_warps, num_stages) timed per shape: the
# best launches of Llama-3.1-8B's projections on the H200 (`benchmarks/kernel.py gemv`): one K slice
# for K = 4096 (qkv, o_proj, gate_up, lm_head), four for the down projection's 14336. (K split
# 2-4 ways for qkv and o_proj, summed by the last split, stayed slower than one slice at one
# row: `benchmarks/kernel.py gemv --rows 1 --shapes qkv o_proj`.)
CANDIDATES = (
    (64, 128, 1, 4, 4), (64, 128, 1, 4, 6), (64, 64, 1, 4, 8), (64, 128, 2, 4, 4),
    (128, 128, 4, 8, 4),
)  # fmt: skip


def by_shape(model: nn.Module) -> dict[Shape, list[Projection]]:
    """The model's full-precision Projections grouped by (out, in, gated), in module order (a
    quantized one runs its own method's kernels: runtime/models/quant/)."""
    groups: dict[Shape, list[Projection]] = {}
    for m in model.modules():
        if isinstance(m, Projection) and m.quant is None:
            groups.setdefault(m.shape, []).append(m)
    return groups


def choose_gemv(model: nn.Module, sizes: Sequence[int], mode: str) -> dict[int, GemvPlan]:
    """Per batch size the GEMV serves, the plan of the model's projections: each shape's launch
    timed fastest (none with mode off, off CUDA, on a GPU older than compute capability 8.0, or
    where no candidate launch fits). Whether a size keeps its plan is the graph runner's call
    (auto: the faster whole step)."""
    plans: dict[int, dict[Shape, Any]] = {}
    for shape, mods in by_shape(model).items():
        device = mods[0].weight.device
        if mode == "off" or device.type != "cuda" or not _compiles_for(device):
            continue
        for size, launch in _pick(mods, sizes).items():
            plans.setdefault(size, {})[shape] = launch
    return {size: GemvPlan(launches) for size, launches in plans.items()}


def _compiles_for(device: torch.device) -> bool:
    from weft.kernels.skinny import supports_gemv

    return supports_gemv(device)


def _pick(mods: list[Projection], sizes: Sequence[int]) -> dict[int, Any]:
    """Every size the GEMV serves, with the candidate launch timed fastest over all of mods (at
    the largest such size: the GEMV's time hardly depends on the rows, x^T being padded to 16)."""
    from weft.kernels.skinny import MAX_ROWS, GemvLaunch

    small = [s for s in sizes if s <= MAX_ROWS]
    if not small:
        return {}
    launches = [GemvLaunch(*c) for c in CANDIDATES]
    timer = _GraphTimer(mods, max(small))
    timed = [(timer.us(timer.gemv_op(c)), c) for c in launches if timer.fits(c)]
    if not timed:  # e.g. a GPU with less shared memory than every candidate asks for
        m0 = mods[0]
        logger.warning("no skinny GEMV launch fits the [%d, %d] projections: cuBLAS serves them",
                       m0.out_features, m0.in_features)  # fmt: skip
        return {}
    return dict.fromkeys(small, min(timed, key=lambda t: t[0])[1])


class _GraphTimer:
    """Median microseconds of one CUDA-graph replay of an op over all of `mods` (every layer's
    weight, so none stays in the L2 for the next), as the decode graphs will run them."""

    def __init__(self, mods: list[Projection], rows: int, reps: int = 5) -> None:
        m0 = mods[0]
        self.mods, self.reps = mods, reps
        width = 2 * m0.in_features if m0.gated else m0.in_features
        self.x = torch.randn(rows, width, dtype=m0.weight.dtype, device=m0.weight.device)

    @staticmethod
    def gemv_op(launch: Any) -> Callable[[Projection, torch.Tensor], torch.Tensor]:
        from weft.kernels.skinny import gemv

        def op(m: Projection, x: torch.Tensor) -> torch.Tensor:
            return gemv(x, m.weight, m.bias, silu_mul=m.gated, launch=launch)

        return op

    @torch.no_grad()
    def fits(self, launch: Any) -> bool:
        """Whether `launch` compiles and runs here (its shared memory fits the device)."""
        from triton.runtime.errors import OutOfResources

        try:
            self.gemv_op(launch)(self.mods[0], self.x)
        except OutOfResources:
            return False
        return True

    @torch.no_grad()
    def us(self, op: Callable[[Projection, torch.Tensor], torch.Tensor]) -> float:
        x = self.x
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            op(self.mods[0], x)  # compiles and warms up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for m in self.mods:
                op(m, x)
        return replay_us(graph, self.reps)


##### The cuBLAS path #####

LIBRARIES = ("cublas", "cublaslt")
# cuBLASLt is taken only where it saves at least this share of the GEMMs' time: a smaller
# difference is within the timing's noise (H200: down at batch 64, 33.2 vs 37.4 us per layer;
# at batch 8 the other way, 36.1 vs 32.9: `benchmarks/kernel.py blas --tokens 8 64`)
MIN_GAIN = 0.02


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


def choose_blas(sizes: Sequence[int], time_ms: Callable[[str, int], float]) -> dict[int, str]:
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
    """time_ms(library, batch <= max_batch) for the model's projection GEMMs (every full-precision
    nn.Linear, in module order, on its own weights, so no layer's weights stay in the L2 for the
    next): the median of `reps` passes over all of them, after one warm-up pass."""
    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and getattr(m, "quant", None) is None]  # fmt: skip
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


def replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median microseconds of `reps` replays of `graph` (after one more to warm up), each timed
    with CUDA events."""
    graph.replay()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
