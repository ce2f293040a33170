"""The FP8 kernels (kernels/fp8.py, kernels/fp8_gemv.py) on CPU under TRITON_INTERPRET=1 against
their float32 references: the per-token / static activation quantization (SiLU-and-mul folded in)
and the skinny FP8 GEMV (W8A8) over 1-32 rows, split K, bias, uneven shapes, static scales."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close

interpreted = test_kernels.interpreted_in(__file__)
FP8 = torch.float8_e4m3fn

if INTERPRETING:  # kernels/ loaded by path as this package (test_kernels did it on import)
    fp8: Any = importlib.import_module("_weft_kernels_interpreted.fp8")
    fg: Any = importlib.import_module("_weft_kernels_interpreted.fp8_gemv")
    GemvLaunch: Any = importlib.import_module("_weft_kernels_interpreted.skinny").GemvLaunch


def _kernel_input(x: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    if not silu_mul:
        return x.float()
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype).float()


def _fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k) / k**0.5
    w[0] *= 50.0  # a row far larger than the others: scales are per row
    return fp8.quantize_per_channel(w)


@pytest.mark.parametrize(
    "rows, k, dtype, silu_mul, static",
    [
        (1, 64, torch.float32, False, False),
        (5, 100, torch.float16, False, False),  # uneven K: masked tail
        (3, 5000, torch.float32, False, False),  # K past one 4096 block: two tiles per row
        (4, 48, torch.float16, True, False),  # silu(gate) * up folded in
        (6, 64, torch.float32, False, True),  # a static (checkpoint) input_scale
        (2, 32, torch.float16, True, True),
    ],
)
@interpreted
def test_quantize_activations(
    rows: int, k: int, dtype: torch.dtype, silu_mul: bool, static: bool
) -> None:
    x = (torch.randn(rows, (2 if silu_mul else 1) * k) * 3).to(dtype)
    x[0, 1] = 40.0  # an outlier: row 0's scale follows it, the others' do not
    scale_in = torch.tensor(0.05) if static else None
    q, scale = fp8.quantize_activations(x, scale_in, silu_mul=silu_mul)
    if static:
        q_ref, scale_ref = fp8.quantize_static_ref(x, scale_in, silu_mul), scale_in.expand(rows, 1)
    else:
        q_ref, scale_ref = fp8.quantize_per_token_ref(x, silu_mul)
    assert q.dtype == FP8 and q.shape == (rows, k) and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, scale_ref.float(), rtol=1e-6, atol=0)
    # NOTE: the interpreter's float32 -> fp8 conversion is not the GPU's: it rounds ties away
    # from zero, and a mantissa that rounds up past 1.875 loses its carry (31.4 -> 16, not 32).
    # Each value must be within one e4m3 step of the exact x / scale, or be that carry case;
    # tests/gpu/test_fp8_cuda.py compares the compiled kernel bit for bit.
    exact = (_kernel_input(x, silu_mul) / scale).clamp(-448.0, 448.0)  # static: saturated
    step_ok = (q.float() - exact).abs() <= exact.abs() / 16 + 2**-9
    pow2 = q_ref.float().abs().log2() == q_ref.float().abs().log2().round()
    carry = pow2 & (q.float() * 2 == q_ref.float())
    assert (step_ok | carry).all()
    assert (q.float() != q_ref.float()).float().mean() < 0.1
    if not static:  # each row's largest value lands on FP8_MAX
        assert torch.allclose(q.float().abs().amax(1), torch.full((rows,), 448.0))


def test_quantize_per_channel_round_trips() -> None:
    """Plain torch (the quantize-at-load path, any device): each row within one e4m3 step."""
    from weft.kernels.fp8 import quantize_per_channel

    w = torch.randn(24, 40) * torch.logspace(-3, 2, 24)[:, None]
    w[3] = 0.0  # an all-zero row stays zero (no division by zero)
    q, scale = quantize_per_channel(w.to(torch.bfloat16))
    assert q.dtype == FP8 and scale.shape == (24,) and scale.dtype == torch.float32
    back = q.float() * scale[:, None]
    ref = w.to(torch.bfloat16).float()
    assert ((back - ref).abs() <= ref.abs() / 16 + scale[:, None] * 2**-9).all()
    assert not back[3].any()
    assert torch.allclose(q.float().abs().amax(1)[torch.arange(24) != 3], torch.tensor(448.0))


GEMV_CASES = [
    # rows, n, k, dtype, bias, silu_mul, GemvLaunch(block_n, block_k, split_k, warps, stages)
    # (float16 and float32: the interpreter's bfloat16 dots are wrong; tests/gpu has bf16)
    (1, 48, 64, torch.float32, False, False, (16, 32, 1, 4, 2)),
    (3, 40, 96, torch.float16, True, False, (16, 32, 1, 2, 3)),
    (4, 64, 128, torch.float16, False, True, (32, 32, 2, 4, 2)),  # split K, gate | up
    (2, 33, 70, torch.float16, True, True, (16, 16, 4, 1, 1)),  # uneven n, k and slices
    (16, 64, 256, torch.float16, False, False, (64, 64, 1, 4, 4)),  # even: unmasked loads
    (17, 64, 128, torch.float32, True, False, (32, 64, 2, 4, 2)),  # x^T padded to 32 columns
    (32, 96, 192, torch.float16, False, True, (32, 64, 4, 4, 2)),  # 3 slices of 64
]


def own_quantization_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    b: torch.Tensor | None = None,
    silu_mul: bool = False,
    static: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp8_gemv_ref's product over x as the interpreted quantization kernel rounds it (its fp8
    conversion is not the GPU's: test_quantize_activations; tests/gpu compare the real one to
    fp8_gemv_ref)."""
    xq, xs = fp8.quantize_activations(x, static, silu_mul=silu_mul)
    y = (xq.float() @ w.float().T) * xs.float() * scale.float()[None, :]
    return y if b is None else y + b.float()


@pytest.mark.parametrize("rows, n, k, dtype, bias, silu_mul, launch", GEMV_CASES)
@interpreted
def test_fp8_gemv(
    rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, silu_mul: bool, launch: tuple
) -> None:
    x = torch.randn(rows + 2, (2 if silu_mul else 1) * k).to(dtype)[1:-1]  # rows at an offset
    w, scale = _fp8_weight(n, k)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((rows, n), NAN, dtype=dtype)
    fg.fp8_gemv(x, w, scale, b, silu_mul=silu_mul, out=out, launch=GemvLaunch(*launch))
    assert_close(out, own_quantization_ref(x, w, scale, b, silu_mul), TOL[dtype])


@interpreted
def test_fp8_gemv_default_launch_and_its_split_sum_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default launch (split K for a long K) with the sum done by the last split to arrive
    and, with no arrival counters at hand, by a launch of its own: the same bits."""
    rows, n, k = 5, 64, 8192
    x = torch.randn(rows, k).to(torch.float16)
    w, scale = _fp8_weight(n, k)
    assert fg.default_launch(n, k).split_k == 2
    first = fg.fp8_gemv(x, w, scale)
    monkeypatch.setattr(fg, "arrival_counters", lambda *args: None)
    second = fg.fp8_gemv(x, w, scale)
    assert_close(first, own_quantization_ref(x, w, scale), TOL[torch.float16])
    assert torch.equal(first, second)


@interpreted
def test_fp8_gemv_static_input_scale() -> None:
    """A checkpoint's static activation scale: x quantized with it, as the prefill GEMM does."""
    x = torch.randn(3, 64).to(torch.bfloat16)
    w, scale = _fp8_weight(48, 64)
    static = torch.tensor(0.02)
    out = fg.fp8_gemv(x, w, scale, input_scale=static)
    assert_close(out, own_quantization_ref(x, w, scale, static=static), TOL[torch.bfloat16])
    assert not torch.allclose(out.float(), own_quantization_ref(x, w, scale), atol=1e-3)


@interpreted
def test_fp8_gemv_refuses_what_it_cannot_serve() -> None:
    w, scale = _fp8_weight(16, 32)
    with pytest.raises(ValueError, match="1..32 rows"):
        fg.fp8_gemv(torch.randn(33, 32), w, scale)
    with pytest.raises(ValueError, match="wants 64 .gate"):
        fg.fp8_gemv(torch.randn(1, 32), w, scale, silu_mul=True)
    with pytest.raises(AssertionError, match="weight: dtype"):
        fg.fp8_gemv(torch.randn(1, 32), w.float(), scale)


def test_fp8_linear_ref_matches_a_dequantized_matmul() -> None:
    """The W8A8 reference is the dequantized product within fp8's activation rounding."""
    from weft.kernels.fp8 import fp8_linear_ref, quantize_per_channel

    x, w = torch.randn(7, 64), torch.randn(32, 64) / 8
    q, scale = quantize_per_channel(w)
    exact = x @ (q.float() * scale[:, None]).T
    for input_scale in (None, torch.tensor(x.abs().max().item() / 448.0)):
        y = fp8_linear_ref(x, q, scale, None, input_scale)
        assert ((y - exact).norm() / exact.norm()).item() < 0.05
