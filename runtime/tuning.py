"""TuningConfig: how the CUDA path runs where the runtime otherwise decides by measurement (one
field of EngineConfig, validated with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from weft.runtime.config_types import check_fields, check_known


@dataclass(frozen=True)
class TuningConfig:
    """How the CUDA path runs where the runtime otherwise decides by measurement: each default is
    the measured choice (BENCHMARKS.md); the other values force one side, for comparing. On the
    command line: `weft serve --gemv off --graph-blas cublas ...`."""

    # decode CUDA graphs of 1-16 rows run the projections on weft's skinny GEMV: auto where the
    # whole step replays faster with it (timed per batch size at capture), on / off everywhere
    gemv: Literal["auto", "on", "off"] = "auto"
    # the cuBLAS path of each decode graph's GEMMs: auto measures per batch size at capture
    graph_blas: Literal["auto", "cublas", "cublaslt"] = "auto"
    # the RMSNorm and skinny GEMV kernels launch as programmatic dependents on sm_90+ (each may
    # start while the kernel before it finishes); true launches them plainly
    disable_pdl: bool = False
    # the triton extend kernel walks a work list of query blocks instead of its full grid: auto
    # over an fp8 KV pool (where it measured faster; over bf16 it measured slower)
    extend_work: Literal["auto", "on", "off"] = "auto"
    # threads computing grammar masks ahead of the step (llguidance); None: min(3, cores - 1)
    grammar_mask_threads: int | None = None
    # speculative decoding's short extends (a verify step, the draft model's catch-up) run as
    # decode rows, one per token, each attending to its request's KV up to its own position:
    # auto where decode CUDA graphs run and the rows fit the largest graph (it replays one,
    # reading the prefix's KV once per row); on also without graphs; off runs one eager extend
    spec_decode_rows: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.gemv not in ("auto", "on", "off"):
            raise ValueError(f"gemv must be 'auto', 'on' or 'off', got {self.gemv!r}")
        if self.graph_blas not in ("auto", "cublas", "cublaslt"):
            raise ValueError(
                f"graph_blas must be 'auto', 'cublas' or 'cublaslt', got {self.graph_blas!r}"
            )
        if self.extend_work not in ("auto", "on", "off"):
            raise ValueError(f"extend_work must be 'auto', 'on' or 'off', got {self.extend_work!r}")
        if self.spec_decode_rows not in ("auto", "on", "off"):
            raise ValueError(
                f"spec_decode_rows must be 'auto', 'on' or 'off', got {self.spec_decode_rows!r}"
            )
        if self.grammar_mask_threads is not None and self.grammar_mask_threads < 1:
            raise ValueError(f"grammar_mask_threads must be >= 1, got {self.grammar_mask_threads}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> TuningConfig:
        """Build from keyword arguments, naming any unknown one."""
        check_known(cls, kwargs, "tuning option")
        return cls(**kwargs)
