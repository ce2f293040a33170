"""The skinny GEMV's launch per projection shape for the smallest decode batches, timed in CUDA
graphs on the model's own weights before capture (the graph runner then keeps, per batch size,
the faster step: runtime/executor/cuda_graph.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from weft.runtime.models.layers import Projection

logger = logging.getLogger(__name__)
Shape = tuple[int, int, bool]  # (out features, in features, gated)
# GemvLaunch fields (block_n, block_k, split_k, num_warps, num_stages) timed per shape: the
# best launches of Llama-3.1-8B's projections on the H200 (benchmarks/gemv_chain.py): one K slice
# for K = 4096 (qkv, o_proj, gate_up, lm_head), four for the down projection's 14336. (K split
# 2-4 ways for qkv and o_proj, summed by the last split, stayed slower than one slice at one
# row: BENCHMARKS.md, twenty-third session.)
CANDIDATES = (
    (64, 128, 1, 4, 4), (64, 128, 1, 4, 6), (64, 64, 1, 4, 8), (64, 128, 2, 4, 4),
    (128, 128, 4, 8, 4),
)  # fmt: skip


def mode_from_env() -> str:
    """WEFT_GEMV: auto (per batch size the GEMV serves, the GEMV where the decode step replays
    faster with it; the default), on (every such size) or off (cuBLAS only), for comparison.
    Each projection shape takes its fastest candidate launch."""
    mode = os.environ.get("WEFT_GEMV", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"WEFT_GEMV must be auto, on or off, got {mode!r}")
    return mode


def fold_from_env() -> bool:
    """WEFT_FOLD_NORM: on (where a decode graph's projections all run the skinny GEMV, each
    residual add goes into the GEMV before it and each RMSNorm into the GEMV after it, two norm
    launches a layer fewer: LlamaForCausalLM.folds_norms) or off (the default until it is timed
    on the GPU: the norms launch)."""
    mode = os.environ.get("WEFT_FOLD_NORM", "off")
    if mode not in ("on", "off"):
        raise ValueError(f"WEFT_FOLD_NORM must be on or off, got {mode!r}")
    return mode == "on"


def by_shape(model: nn.Module) -> dict[Shape, list[Projection]]:
    """The model's Projections grouped by (out, in, gated), in module order."""
    groups: dict[Shape, list[Projection]] = {}
    for m in model.modules():
        if isinstance(m, Projection):
            groups.setdefault((m.out_features, m.in_features, m.gated), []).append(m)
    return groups


def choose(
    model: nn.Module, sizes: Sequence[int], mode: str, sum_here: bool = True
) -> dict[Shape, dict[int, Any]]:
    """Set each Projection's gemv_launches (batch size -> GemvLaunch) for every size the GEMV
    serves, with the launch timed fastest for its shape (none with mode off, off CUDA, on a GPU
    older than compute capability 8.0, or where no candidate launch fits); returns them per
    shape. Whether a size keeps them is the graph runner's call (auto: the faster whole step).
    `sum_here`: split-K launches sum their slices in the GEMV (GemvLaunch.sum_here)."""
    picks: dict[Shape, dict[int, Any]] = {}
    for shape, mods in by_shape(model).items():
        device = mods[0].weight.device
        serves = mode != "off" and device.type == "cuda" and _compiles_for(device)
        picks[shape] = _pick(mods, sizes, sum_here) if serves else {}
        for m in mods:
            m.gemv_launches = dict(picks[shape])
    return picks


def _compiles_for(device: torch.device) -> bool:
    from weft.kernels.skinny import supports_gemv

    return supports_gemv(device)


def drop_size(model: nn.Module, size: int) -> list[tuple[Projection, Any]]:
    """Take size's GEMV launch off every Projection (cuBLAS serves it); returns what was taken."""
    mods = [m for group in by_shape(model).values() for m in group]
    return [(m, m.gemv_launches.pop(size)) for m in mods if size in m.gemv_launches]


def restore_size(dropped: list[tuple[Projection, Any]], size: int) -> None:
    for m, launch in dropped:
        m.gemv_launches[size] = launch


def _pick(mods: list[Projection], sizes: Sequence[int], sum_here: bool) -> dict[int, Any]:
    """Every size the GEMV serves, with the candidate launch timed fastest over all of mods (at
    the largest such size: the GEMV's time hardly depends on the rows, x^T being padded to 16)."""
    from weft.kernels.skinny import MAX_ROWS, GemvLaunch

    small = [s for s in sizes if s <= MAX_ROWS]
    if not small:
        return {}
    launches = [GemvLaunch(*c, sum_here=sum_here) for c in CANDIDATES]
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
        from weft.runtime.executor.cuda_graph import replay_us

        return replay_us(graph, self.reps)
