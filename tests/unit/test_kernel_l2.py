"""L2 prefetch hints (kernels/l2.py): which bytes they cover."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from weft.kernels.l2 import L2Prefetch  # noqa: E402


def test_a_hint_covers_the_first_fraction_of_the_bytes_in_place() -> None:
    data = torch.randn(10, 7, dtype=torch.bfloat16)
    for fraction, nbytes in ((1.0, 140), (0.5, 70), (0.01, 1)):
        base = L2Prefetch(data, fraction).base()
        assert base.dtype == torch.uint8 and base.numel() == nbytes
        assert base.data_ptr() == data.data_ptr()  # a view: nothing is copied


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_a_bad_fraction_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        L2Prefetch(torch.zeros(4), fraction).base()
