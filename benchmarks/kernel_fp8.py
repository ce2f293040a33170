"""`kernel.py fp8`: the FP8 projections at Llama-3.1-8B's shapes, in CUDA graphs over distinct
weights: bf16 cuBLAS, the FP8 skinny GEMV (default and swept launches) and the W8A8 path
(per-token quantization + row-wise _scaled_mm), per row count, each against the copy speed of its
weight bytes. Where the GEMV stops beating _scaled_mm is where GEMV_MAX_ROWS
(runtime/models/quant/fp8.py) belongs."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from kernel_gemm import SHAPES, graph_us
from triton.runtime.errors import OutOfResources

from weft.kernels.fp8 import quantize_activations, quantize_per_channel, scaled_mm
from weft.kernels.fp8_gemv import default_launch, fp8_gemv, fp8_gemv_ref
from weft.kernels.skinny import GemvLaunch

DEV = "cuda"
SWEEP = [GemvLaunch(*c) for c in (
    (64, 128, 1, 4, 4), (64, 256, 1, 4, 4), (64, 256, 2, 4, 4), (128, 128, 1, 4, 4),
    (64, 128, 2, 4, 6), (64, 128, 4, 4, 4), (128, 256, 4, 8, 3), (32, 256, 1, 4, 4),
)]  # fmt: skip


def _w8a8(x: torch.Tensor, silu: bool, wq: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    xq, xs = quantize_activations(x, silu_mul=silu)
    return scaled_mm(xq, xs, wq[0], wq[1], None, torch.bfloat16)


def _gemv(x: torch.Tensor, silu: bool, launch: GemvLaunch | None,
          wq: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    return fp8_gemv(x, wq[0], wq[1], silu_mul=silu, launch=launch)


def bench_fp8(ceiling: float, rows_list: list[int], layers: int, reps: int, sweep: bool) -> None:
    for name, n, k, silu in SHAPES:
        if name == "lm_head":  # stays bf16 under quantization='fp8'
            continue
        count = max(2, min(layers, (4 << 30) // (n * k * 2)))
        bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5 for _ in range(count)]
        fp8 = [quantize_per_channel(w) for w in bf16]
        # the weights' bytes at the copy bandwidth (ceiling in GB/s), in us
        copy8, copy16 = n * k / ceiling / 1e3, 2 * n * k / ceiling / 1e3
        print(f"\n{name} [{n} x {k}]: copy speed fp8 {copy8:.1f} us, bf16 {copy16:.1f} us; "
              f"default GEMV launch {default_launch(n, k)}")  # fmt: skip
        for rows in rows_list:
            x = torch.randn(rows, 2 * k if silu else k, dtype=torch.bfloat16, device=DEV)
            act = x if not silu else F.silu(x[:, :k]) * x[:, k:]
            cublas = graph_us(lambda w, a=act: F.linear(a, w), bf16, reps)
            w8a8 = graph_us(partial(_w8a8, x, silu), fp8, reps)
            line = (f"  rows {rows:4}: bf16 cuBLAS {cublas:7.1f} us ({copy16 / cublas:4.0%}); "
                    f"W8A8 quant + _scaled_mm {w8a8:7.1f} us ({copy8 / w8a8:4.0%})")  # fmt: skip
            if rows <= 32:
                want = fp8_gemv_ref(x, *fp8[0], None, silu)
                err = ((fp8_gemv(x, *fp8[0], silu_mul=silu).float() - want).norm()
                       / want.norm()).item()  # fmt: skip
                assert err < 1e-2, f"{name} rows {rows}: GEMV relative error {err:.3g}"
                gemv = graph_us(partial(_gemv, x, silu, None), fp8, reps)
                line += f"; FP8 GEMV {gemv:7.1f} us ({copy8 / gemv:4.0%})"
            print(line, flush=True)
            if sweep and rows <= 32:
                for launch in SWEEP:
                    try:
                        us = graph_us(partial(_gemv, x, silu, launch), fp8, reps)
                    except OutOfResources:
                        print(f"      {launch}: out of shared memory")
                        continue
                    print(f"      {us:7.1f} us ({copy8 / us:4.0%})  {launch}")
        del bf16, fp8
        torch.cuda.empty_cache()
