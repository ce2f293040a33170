"""How weft's kernels launch on GPUs: as programmatic dependents (WEFT_PDL), and who sums their
split results (WEFT_SPLIT_SUM)."""

from __future__ import annotations

import os

MODES = ("on", "all", "off")
SUM_MODES = ("here", "launch")


def pdl_mode_from_env() -> str:
    """WEFT_PDL: on (the default: the RMSNorm and skinny GEMV kernels), all (also rotary and the
    decode attention kernels; no gain on the H200, BENCHMARKS.md, twenty-second session) or off.
    A programmatic dependent may launch while the kernel before it finishes and waits for it
    before it touches any of its inputs or outputs; the kernels check the GPU's support (compute
    capability 9.0+)."""
    mode = os.environ.get("WEFT_PDL", "on")
    if mode not in MODES:
        raise ValueError(f"WEFT_PDL must be on, all or off, got {mode!r}")
    return mode


def sum_here_from_env() -> bool:
    """WEFT_SPLIT_SUM: here (the default: in a skinny GEMV with split K and in the decode
    attention with split KV, the last program of a tile to finish sums or merges the splits'
    partial results) or launch (one more kernel does it, for comparison)."""
    mode = os.environ.get("WEFT_SPLIT_SUM", "here")
    if mode not in SUM_MODES:
        raise ValueError(f"WEFT_SPLIT_SUM must be here or launch, got {mode!r}")
    return mode == "here"
