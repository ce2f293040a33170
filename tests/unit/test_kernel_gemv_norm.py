"""The skinny GEMV with the residual-add + RMSNorm between two projections folded in
(kernels/skinny.py: AddNorm on the first, NormedX on the second) on CPU under TRITON_INTERPRET=1,
against the unfolded kernel chain (projection, fused_add_rmsnorm, projection) and its float32
reference."""

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

EPS = 1e-5
CASES = [
    # rows, k (the first projection's in), hidden, n2 (the second's out), dtype, biases, gated,
    # the two launches (block_n, block_k, split_k, warps, stages); float16/32 only (see
    # test_kernel_gemv.py), bfloat16 in tests/gpu
    (1, 64, 48, 32, torch.float32, False, False, (16, 32, 1, 4, 2), (16, 16, 1, 4, 2)),
    (3, 96, 64, 40, torch.float16, True, False, (16, 32, 1, 2, 3), (16, 32, 2, 4, 2)),
    (4, 64, 64, 64, torch.float16, False, True, (32, 32, 2, 4, 2), (32, 32, 1, 4, 2)),  # split
    (2, 70, 33, 48, torch.float16, True, True, (16, 16, 4, 1, 1), (16, 16, 1, 1, 1)),  # uneven
    (16, 128, 128, 64, torch.float16, False, False, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4)),
]


@pytest.mark.parametrize("rows, k, hidden, n2, dtype, bias, gated, first, second", CASES)
@interpreted
def test_folded_norm_between_two_gemvs_is_the_unfolded_chain(
    rows: int, k: int, hidden: int, n2: int, dtype: torch.dtype, bias: bool, gated: bool,
    first: tuple, second: tuple,
) -> None:  # fmt: skip
    x = torch.randn(rows, (2 if gated else 1) * k).to(dtype)
    w1 = (torch.randn(hidden, k) / k**0.5).to(dtype)
    w2 = (torch.randn(n2, hidden) / hidden**0.5).to(dtype)
    b1, b2 = (torch.randn(hidden).to(dtype), torch.randn(n2).to(dtype)) if bias else (None, None)
    gamma = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype)
    launch1, launch2 = wk.GemvLaunch(*first), wk.GemvLaunch(*second)

    # unfolded: the projection, fused_add_rmsnorm in place, the next projection
    y1 = wk.gemv(x, w1, b1, silu_mul=gated, launch=launch1)
    h_unfolded = residual.clone()
    wk.fused_add_rmsnorm(y1, h_unfolded, gamma, EPS)
    unfolded = wk.gemv(y1, w2, b2, launch=launch2)
    normed, h = ref.fused_add_rmsnorm_ref(ref.gemv_ref(x, w1, b1, gated).to(dtype), residual,
                                          gamma, EPS)  # fmt: skip
    expected = ref.gemv_ref(normed.to(dtype), w2, b2)

    squares = torch.full((rows, wk.norm_tiles(hidden, launch1)), NAN)
    folded_h = residual.clone()
    got = wk.gemv(x, w1, b1, silu_mul=gated, launch=launch1,
                  add_norm=wk.AddNorm(folded_h, squares))  # fmt: skip
    assert got is folded_h
    assert torch.equal(folded_h, h_unfolded)  # the same rounded sum, in place
    assert_close(folded_h, h, TOL[dtype])
    assert_close(squares.sum(1), folded_h.float().pow(2).sum(1), 1e-5)
    out = torch.full((rows, n2), NAN, dtype=dtype)
    wk.gemv(folded_h, w2, b2, out=out, launch=launch2,
            normed_x=wk.NormedX(gamma, squares, EPS))  # fmt: skip
    assert torch.equal(folded_h, h_unfolded)  # x is read, not written
    assert_close(out, expected, TOL[dtype])
    # the same values as the unfolded chain, up to the order the squares are summed in
    assert_close(out, unfolded.float(), 1e-6 if dtype == torch.float32 else 2e-4)
    counters = wk.skinny.arrival_counters(torch.device("cpu"), "gemv", 1)
    assert counters is None or not counters.any()


@interpreted
def test_folded_norm_refuses_what_it_cannot_serve() -> None:
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    launch = wk.GemvLaunch(16, 16, 2, 1, 1, sum_here=False)
    squares = torch.zeros(2, 1)
    add = wk.AddNorm(torch.zeros(2, 16), squares)
    normed = wk.NormedX(torch.ones(32), squares, EPS)
    with pytest.raises(ValueError, match="summed in the GEMV"):
        wk.gemv(x, w, launch=launch, add_norm=add)
    with pytest.raises(ValueError, match="no out"):
        wk.gemv(x, w, add_norm=add, out=torch.zeros(2, 16))
    with pytest.raises(ValueError, match="pass one"):
        wk.gemv(x, w, add_norm=add, normed_x=normed)
    with pytest.raises(ValueError, match="not \\[gate \\| up\\]"):
        wk.gemv(torch.randn(2, 64), w, silu_mul=True, normed_x=normed)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        wk.gemv(x, w, normed_x=wk.NormedX(torch.ones(32), squares, -1.0))
    with pytest.raises(AssertionError, match="add_norm.squares"):  # one column per tile
        wk.gemv(x, w, add_norm=wk.AddNorm(torch.zeros(2, 16), torch.zeros(2, 3)))
    with pytest.raises(AssertionError, match="normed_x.weight"):  # K long
        wk.gemv(x, w, normed_x=wk.NormedX(torch.ones(16), squares, EPS))
