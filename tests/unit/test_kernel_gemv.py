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


@pytest.mark.parametrize("case", [c for c in CASES if c[-1][2] > 1])
@interpreted
def test_split_k_summed_by_the_last_program_equals_the_sum_launch(
    case: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split K summed by each tile's last program to arrive (no second launch) against one more
    launch doing the sum (what runs where no arrival counters are at hand): the same bits, and
    the arrival counters are zeros again after."""

    rows, n, k, dtype, bias, silu_mul, launch = case
    x = torch.randn(rows, (2 if silu_mul else 1) * k).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    sum_launch, counters_of = wk.skinny._split_sum_kernel, wk.skinny.arrival_counters
    outs = []
    for summed_here in (True, False):
        if summed_here:  # must not launch the sum kernel
            monkeypatch.setattr(wk.skinny, "_split_sum_kernel", None)
        else:  # no counters: the sum kernel's launch
            monkeypatch.setattr(wk.skinny, "_split_sum_kernel", sum_launch)
            monkeypatch.setattr(wk.skinny, "arrival_counters", lambda *args: None)
        out = torch.full((rows, n), NAN, dtype=dtype)
        wk.gemv(x, weight, b, silu_mul=silu_mul, out=out, launch=wk.GemvLaunch(*launch))
        outs.append(out)
    monkeypatch.setattr(wk.skinny, "arrival_counters", counters_of)
    assert_close(outs[0], ref.gemv_ref(x, weight, b, silu_mul), TOL[dtype])
    assert torch.equal(outs[0], outs[1])
    counters = wk.arrivals.arrival_counters(torch.device("cpu"), "gemv", 1)
    assert counters is not None and not counters.any()


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
