"""Which of weft's kernels launch as programmatic dependents (WEFT_PDL), on GPUs that support it."""

from __future__ import annotations

import os

MODES = ("on", "all", "off")


def pdl_mode_from_env() -> str:
    """WEFT_PDL: on (the default: the RMSNorm and skinny GEMV kernels), all (also rotary and the
    decode attention kernels; not yet measured, for comparison) or off. A programmatic dependent
    may launch while the kernel before it finishes and waits for it before it touches any of
    its inputs or outputs; the kernels check the GPU's support (compute capability 9.0+)."""
    mode = os.environ.get("WEFT_PDL", "on")
    if mode not in MODES:
        raise ValueError(f"WEFT_PDL must be on, all or off, got {mode!r}")
    return mode
