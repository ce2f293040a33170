"""FP8 (e4m3) W8A8 building blocks: per-channel weight and per-token activation quantization, the
cuBLASLt `torch._scaled_mm` GEMM with its scales fused, and their float32 references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, FP8_MAX, check_tensor

FP8 = torch.float8_e4m3fn  # weights and activations (the KV pool's FP8_KV is the same type)
SCALE_EPS = 1e-12  # floor of an amax: an all-zero row gets a tiny scale, not a division by zero
SCALED_MM_ALIGN = 16  # _scaled_mm wants K and N multiples of 16


##### Quantization (torch: any device) #####


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], float32 scale [N]): row n is scaled so its largest magnitude
    maps to FP8_MAX; weight[n] ~= q[n].float() * scale[n]. Runs where the weight lies (on the GPU
    for quantize-at-load)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(SCALE_EPS) / FP8_MAX  # [N]
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_per_token_ref(
    x: torch.Tensor, silu_mul: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or [M, 2K] gate | up with silu_mul: silu(gate) * up rounded to x's dtype first,
    as silu_and_mul stores it) -> (fp8 [M, K], float32 scale [M, 1])."""
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp_min(SCALE_EPS) / FP8_MAX  # [M, 1]
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static_ref(
    x: torch.Tensor, scale: torch.Tensor, silu_mul: bool = False
) -> torch.Tensor:
    """x quantized with a calibrated per-tensor scale (a checkpoint's input_scale), saturated."""
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return (x.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K] (or [M, 2K] with silu_mul)
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
    input_scale: torch.Tensor | None = None,  # [] float32: static activations, else per token
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N] float32
    """W8A8: x quantized per token (or with the static input_scale), times the fp8 weight, both
    scales applied to the float32 sums."""
    if input_scale is None:
        xq, x_scale = quantize_per_token_ref(x, silu_mul)
    else:
        xq, x_scale = quantize_static_ref(x, input_scale, silu_mul), input_scale.float()
    y = (xq.float() @ weight.float().T) * x_scale * weight_scale.float()[None, :]
    return y if bias is None else y + bias.float()


##### The per-token quantization kernel (CUDA; the interpreter in tests) #####


@triton.jit
def _row_tile(X, row, k, mask, stride_xm, K, SILU_MUL: tl.constexpr):  # type: ignore[no-untyped-def]
    """x[row, k] in float32 (silu(gate) * up rounded to x's dtype, with SILU_MUL)."""
    ptrs = X + row * stride_xm + k
    if SILU_MUL:
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (gate * tl.sigmoid(gate) * up).to(X.dtype.element_ty).to(tl.float32)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_kernel(  # type: ignore[no-untyped-def]
    X,  # [M, K] (or [M, 2K] with SILU_MUL)
    Q,  # [M, K] fp8
    S,  # [M] float32 scales out (dynamic), or [1] the static scale in
    K,
    stride_xm,
    stride_qm,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
    SILU_MUL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(S)
    else:  # one pass for the row's amax, one to quantize (the second reads it from the L2)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + offs
            x = _row_tile(X, row, k, k < K, stride_xm, K, SILU_MUL)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + offs
        mask = k < K
        x = _row_tile(X, row, k, mask, stride_xm, K, SILU_MUL)
        q = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(Q + row * stride_qm + k, q.to(Q.dtype.element_ty), mask=mask)


def quantize_activations(
    x: torch.Tensor,  # [M, K], or [M, 2K] (gate | up) with silu_mul
    static_scale: torch.Tensor | None = None,  # [] or [1] float32
    *,
    silu_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]) in one launch: per token (each row's amax -> FP8_MAX),
    or with a static per-tensor scale (then expanded to [M, 1]). With silu_mul the row is
    silu(gate) * up, the down projection's input, without silu_and_mul's own launch."""
    rows, width = x.shape
    k = width // 2 if silu_mul else width
    assert not silu_mul or width == 2 * k, f"silu_mul: x has an odd width {width}"
    check_tensor(x, "x", (rows, width), FLOATS)
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    if static_scale is None:
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    else:
        scale = static_scale.reshape(1).to(torch.float32)
    if rows:
        block = min(triton.next_power_of_2(k), 4096)
        _quantize_kernel[(rows,)](
            x, q, scale, k, x.stride(0), q.stride(0),
            BLOCK=block, STATIC=static_scale is not None, SILU_MUL=silu_mul,
            num_warps=4 if block <= 1024 else 8,
        )  # fmt: skip
    if static_scale is not None:
        return q, scale.expand(rows, 1)
    return q, scale[:, None]


##### The GEMM (cuBLASLt) #####


def scaled_mm(
    xq: torch.Tensor,  # [M, K] fp8, row-major
    x_scale: torch.Tensor,  # [M, 1] float32
    weight: torch.Tensor,  # [N, K] fp8, row-major (its transpose is the column-major operand)
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N] bfloat16
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq @ weight^T) * x_scale * weight_scale (+ bias) through torch._scaled_mm's row-wise
    scaling: cuBLASLt (CUTLASS on sm89) applies both scales and the bias to the float32 sums in
    its epilogue. Row-wise scaling writes bfloat16 only: another out_dtype is cast after."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == FP8 and weight.dtype == FP8, (xq.dtype, weight.dtype)
    assert k % SCALED_MM_ALIGN == 0 and n % SCALED_MM_ALIGN == 0, f"[{n}, {k}] not 16-aligned"
    out = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=x_scale.reshape(m, 1).contiguous(),
        scale_b=weight_scale.reshape(1, n),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
    )
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
