"""The skinny projections (weft.kernels.gemv) against cuBLAS on Llama-3.1-8B's four projection
shapes at 1-4 rows, and the copy ceiling of the same run (kernels.py --gemv)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from kernels import time_ms

# (name, out features, in features, silu_mul): Llama-3.1-8B's projections
SHAPES = (
    ("qkv", 6144, 4096, False),
    ("o_proj", 4096, 4096, False),
    ("gate_up", 28672, 4096, False),
    ("down (+ silu_and_mul)", 4096, 14336, True),
)
# (block_n, block_k, num_warps): 4-16k weights a program reads per step of its K walk
LAUNCHES = [(8, 512, 4), (16, 256, 4), (16, 512, 4), (32, 256, 4), (16, 512, 8), (32, 512, 8),
            (8, 1024, 4), (4, 1024, 2)]  # fmt: skip


def _cublas(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    from weft.kernels import silu_and_mul

    return F.linear(silu_and_mul(x) if silu else x, weight)


def bench_gemv(ceiling: float, rows_list: tuple[int, ...] = (1, 2, 4)) -> None:
    """Per shape and row count: cuBLAS (torch's default library and cuBLASLt; for down, after
    the separate silu_and_mul launch) and the best gemv launches, each in us and % of the copy
    ceiling over the weight's bytes."""
    from weft.kernels import GemvLaunch, gemv, silu_and_mul

    print("\nskinny projections, bf16: us and % of copy speed over the weight's bytes")
    for name, n, k, silu in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        nbytes = weight.numel() * 2
        for rows in rows_list:
            x = torch.randn(rows, 2 * k if silu else k, dtype=torch.bfloat16, device="cuda")
            cells = []
            for lib in ("cublas", "cublaslt"):
                before = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library(lib)
                try:
                    ms = time_ms(partial(_cublas, x, weight, silu))
                finally:
                    torch.backends.cuda.preferred_blas_library(before)
                cells.append(f"{lib} {ms * 1e3:.1f} us ({nbytes / ms / 1e6 / ceiling:.0%})")
            want = (silu_and_mul(x) if silu else x).float() @ weight.float().T
            timed = []
            for bn, bk, w in LAUNCHES:
                launch = GemvLaunch(bn, bk, w)
                run = partial(gemv, x, weight, silu_mul=silu, launch=launch)
                got = run()
                err = ((got.float() - want).norm() / want.norm()).item()
                assert err < 2e-2, f"{name} rows {rows} {launch}: relative error {err:.3g}"
                timed.append((time_ms(run), (bn, bk, w)))
            timed.sort()
            best = ", ".join(
                f"{ms * 1e3:.1f} us ({nbytes / ms / 1e6 / ceiling:.0%}) {cfg}"
                for ms, cfg in timed[:3]
            )
            print(f"  {name} [{n} x {k}] rows {rows}: {' | '.join(cells)}")
            print(f"      gemv best (block_n, block_k, warps): {best}")
