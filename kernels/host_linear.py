"""y = x @ W^T (+ bias) on the CPU in the operand order its BLAS runs fastest for a few rows of x."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# With 2-64 rows of float32 x, MKL's sgemm runs W @ x^T up to 2.7x faster than x @ W^T (F.linear):
# for x @ W^T it packs the whole weight, a second pass over it, where a matrix-vector product
# reads it once. On the 2-core development VM (AMD EPYC), Qwen2.5-1.5B's gate_up [17920, 1536] at
# 5 rows: 18.7 ms against 7.0 (1 row: 5.6 / 5.3); the LM head at 5 rows 185 against 71; from 256
# rows on the two orders are even (`python benchmarks/kernel_host.py`). Speculative verify steps
# (k + 1 rows) and small decode batches are what this serves. bfloat16 scales with the rows
# either way on a CPU without AVX-512-BF16.
HOST_SKINNY_ROWS = (2, 64)


def host_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as (weight @ x^T)^T where that is faster (see above):
    x [..., K] float32 on the CPU with 2-64 rows; F.linear itself otherwise."""
    lo, hi = HOST_SKINNY_ROWS
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not lo <= rows <= hi
    ):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if bias is None:
        y = torch.mm(weight, x2.t()).t().contiguous()
    else:
        y = torch.addmm(bias.unsqueeze(1), weight, x2.t()).t().contiguous()
    return y.view(*x.shape[:-1], weight.shape[0])
