"""SiLU-and-mul: the gated MLP's silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, check_tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    X,  # [T, 2I]: gate then up
    Out,  # [T, I]
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I]
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:], computed in float32, rounded once; returns out."""
    tokens, width = gate_up.shape
    assert width % 2 == 0, f"gate_up width {width} is odd"
    inter = width // 2
    check_tensor(gate_up, "gate_up", (tokens, width), FLOATS)
    if out is None:
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    check_tensor(out, "out", (tokens, inter), (gate_up.dtype,), gate_up.device)
    if tokens:
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4
        )
    return out
