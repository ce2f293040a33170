"""apply_token_bitmask with mask_rows (bitmask rows = request slots) on CPU under TRITON_INTERPRET=1,
against the reference applied to the gathered rows."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


@pytest.mark.parametrize(
    "vocab, width, rows, mask_rows, dtype",
    [
        (100, 4, None, [5, 0, 2, 5], torch.float32),  # every logit row; a slot used twice
        (77, 2, [3, 0], [1, 6], torch.bfloat16),
        (3000, 94, [2], [0], torch.float16),
        (100, 4, [], [], torch.float32),
    ],
)
@interpreted
def test_apply_token_bitmask_mask_rows(
    vocab: int, width: int, rows: list[int] | None, mask_rows: list[int], dtype: torch.dtype
) -> None:
    torch.manual_seed(99)
    logits = torch.randn(4, vocab).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (7, width), dtype=torch.int32)  # 7 slots
    row_t = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    slot_t = torch.tensor(mask_rows, dtype=torch.int32)
    want = ref.apply_token_bitmask_ref(logits, bitmask[slot_t.long()], row_t)
    wk.apply_token_bitmask(logits, bitmask, row_t, mask_rows=slot_t)
    assert torch.equal(logits, want)


@interpreted
def test_apply_token_bitmask_mask_rows_checks_its_length() -> None:
    logits = torch.randn(4, 64)
    bitmask = torch.zeros(7, 2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="masked rows for 4 logit rows"):
        wk.apply_token_bitmask(logits, bitmask, mask_rows=torch.tensor([1, 2]))
    with pytest.raises(AssertionError, match="rows"):
        wk.apply_token_bitmask(logits, bitmask, torch.tensor([0]), torch.tensor([1, 2]))
