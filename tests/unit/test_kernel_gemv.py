"""The skinny projections (kernels/skinny.py) on CPU under TRITON_INTERPRET=1 against the float32
reference: 1-16 rows, split K, bias, SiLU-and-mul folded in, uneven shapes."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref

CASES = [
    # rows, n, k, dtype, bias, silu_mul, GemvLaunch(block_n, block_k, split_k, warps, stages).
    # float16 and float32 only: the interpreter's bfloat16 dots are wrong (tests/gpu has bf16)
    (1, 48, 64, torch.float32, False, False, (16, 32, 1, 4, 2)),  # 2 tiles, masked n
    (3, 40, 96, torch.float16, True, False, (16, 32, 1, 2, 3)),
    (4, 64, 128, torch.float16, False, True, (32, 32, 2, 4, 2)),  # split K, gate | up
    (2, 33, 70, torch.float16, True, True, (16, 16, 4, 1, 1)),  # uneven n, k and slices
    (16, 64, 256, torch.float16, False, False, (64, 64, 1, 4, 4)),  # even: unmasked loads
    (9, 128, 256, torch.float32, True, False, (64, 64, 4, 4, 3)),
]


@pytest.mark.parametrize("rows, n, k, dtype, bias, silu_mul, launch", CASES)
@interpreted
def test_gemv(
    rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, silu_mul: bool, launch: tuple
) -> None:
    x = torch.randn(rows + 2, (2 if silu_mul else 1) * k).to(dtype)[1:-1]  # rows at an offset
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    out = torch.full((rows, n), NAN, dtype=dtype)
    wk.gemv(x, weight, b, silu_mul=silu_mul, out=out, launch=wk.GemvLaunch(*launch))
    assert_close(out, ref.gemv_ref(x, weight, b, silu_mul), TOL[dtype])


@interpreted
def test_gemv_refuses_what_it_cannot_serve() -> None:
    weight = torch.randn(16, 32)
    with pytest.raises(ValueError, match="1..16 rows"):
        wk.gemv(torch.randn(17, 32), weight)
    with pytest.raises(ValueError, match="wants 64 .gate"):
        wk.gemv(torch.randn(1, 32), weight, silu_mul=True)
    with pytest.raises(ValueError, match="power of 2"):
        wk.GemvLaunch(block_n=24)
    with pytest.raises(ValueError, match="must be >= 16"):
        wk.GemvLaunch(block_n=8)
    with pytest.raises(ValueError, match="num_stages"):
        wk.GemvLaunch(num_stages=0)
    assert wk.skinny.supports_gemv(torch.device("cpu"))  # the interpreter runs it anywhere


@pytest.mark.parametrize(
    "rows, n, k, dtype, bias, launch",
    [
        (1, 48, 64, torch.float32, False, (16, 32, 1, 4, 2)),  # 2 tiles of K, masked n
        (3, 40, 96, torch.float16, True, (16, 32, 2, 2, 3)),  # split_k asked: one taken
        (16, 64, 256, torch.float16, False, (64, 64, 1, 4, 4)),  # even: unmasked W loads
        (2, 33, 70, torch.float32, True, (16, 16, 1, 1, 1)),  # uneven n and k
    ],
)
@interpreted
def test_gemv_with_a_folded_norm(
    rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, launch: tuple
) -> None:
    """norm: the projection of rmsnorm(x + residual) * weight, x + residual written to
    residual_out as fused_add_rmsnorm writes it (rounded to the dtype), nothing else touched."""
    x = torch.randn(rows + 2, k).to(dtype)[1:-1]
    residual = torch.randn(rows, k).to(dtype)
    gamma = (1 + 0.1 * torch.randn(k)).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x0, r0 = x.clone(), residual.clone()
    res_out = torch.full_like(residual, NAN)
    out = torch.full((rows, n), NAN, dtype=dtype)
    norm = wk.GemvNorm(residual, gamma, 1e-5, res_out)
    wk.gemv(x, weight, b, out=out, launch=wk.GemvLaunch(*launch), norm=norm)
    h = (x.float() + residual.float()).to(dtype)
    assert torch.equal(res_out, h)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    want = ref.gemv_ref(ref.rmsnorm_ref(h, gamma, 1e-5), weight.float(), b)
    assert_close(out, want, TOL[dtype])


@interpreted
def test_gemv_refuses_a_norm_it_cannot_fold() -> None:
    x, weight = torch.randn(2, 32), torch.randn(16, 32)
    gamma, res = torch.ones(32), torch.randn(2, 32)
    with pytest.raises(ValueError, match="norm and silu_mul"):
        wk.gemv(torch.randn(2, 64), weight, silu_mul=True,
                norm=wk.GemvNorm(res, gamma, 1e-5, torch.empty(2, 32)))  # fmt: skip
    with pytest.raises(ValueError, match="must not be x or norm.residual"):
        wk.gemv(x, weight, norm=wk.GemvNorm(res, gamma, 1e-5, res))
    with pytest.raises(ValueError, match="the same strides"):
        wk.gemv(x, weight, norm=wk.GemvNorm(res, gamma, 1e-5, torch.empty(2, 40)[:, :32]))
