"""L2 prefetch hints (kernels/l2.py): where a kernel issues them and which bytes they cover."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from weft.kernels.l2 import PREFETCH_AT, L2Prefetch  # noqa: E402


def test_a_hint_covers_the_first_fraction_of_the_bytes_in_place() -> None:
    data = torch.randn(10, 7, dtype=torch.bfloat16)
    for fraction, nbytes in ((1.0, 140), (0.5, 70), (0.01, 1)):
        base = L2Prefetch(data, "end", fraction).base()
        assert base.dtype == torch.uint8 and base.numel() == nbytes
        assert base.data_ptr() == data.data_ptr()  # a view: nothing is copied
    assert L2Prefetch(data).code() == PREFETCH_AT["end"]
    assert L2Prefetch(data, "start").code() == PREFETCH_AT["start"]


@pytest.mark.parametrize(
    ("at", "fraction", "message"),
    [("middle", 1.0, "L2Prefetch.at"), ("end", 0.0, "fraction"), ("end", 1.5, "fraction")],
)
def test_a_bad_hint_is_refused(at: str, fraction: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        L2Prefetch(torch.zeros(4), at, fraction).code()


def test_prefetch_l2_alone_needs_cuda() -> None:
    from weft.kernels.l2 import prefetch_l2

    with pytest.raises(ValueError, match="CUDA"):
        prefetch_l2(torch.zeros(4))
