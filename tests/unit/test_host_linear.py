"""host_linear: F.linear's result in the operand order chosen for a few float32 rows on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft.kernels.host_linear import HOST_SKINNY_ROWS, host_linear


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    y = host_linear(x, w, b)
    assert y.shape == (rows, 48) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_leading_dims_and_views() -> None:
    """A [B, T, K] input keeps its leading dims; a non-contiguous x (a column slice) works."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 16, generator=g)
    x = torch.randn(2, 3, 32, generator=g)[..., ::2]
    y = host_linear(x, w)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_other_dtypes_are_linear_itself() -> None:
    """bfloat16 (no faster order on the CPU) and empty inputs go to F.linear unchanged."""
    lo, _ = HOST_SKINNY_ROWS
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    x = torch.randn(lo + 1, 4, dtype=torch.bfloat16)
    assert torch.equal(host_linear(x, w), F.linear(x, w))
    empty = torch.randn(0, 4)
    assert host_linear(empty, w.float()).shape == (0, 8)
