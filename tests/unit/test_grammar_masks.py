"""GrammarMasks (runtime/executor/grammar_masks.py): the rows copied per step, and the CPU apply by slot."""

from __future__ import annotations

import pytest
import torch

from weft.constrain import apply_bitmask
from weft.runtime.executor.grammar_masks import GrammarMasks, copy_runs


@pytest.mark.parametrize(
    ("slots", "max_gap", "runs"),
    [
        ([5], 4, [(5, 6)]),
        ([3, 1, 2], 1, [(1, 4)]),  # adjacent rows: one run whatever the gap allowed
        ([0, 2], 1, [(0, 1), (2, 3)]),  # one row between: copied along only if max_gap > 1
        ([0, 2], 2, [(0, 3)]),
        ([9, 0, 4, 4], 3, [(0, 1), (4, 5), (9, 10)]),  # 3 rows between: not below 3
        ([9, 0, 4, 4], 4, [(0, 5), (9, 10)]),  # duplicates count once
        ([0, 4, 8, 100], 4, [(0, 9), (100, 101)]),
    ],
)
def test_copy_runs(slots: list[int], max_gap: int, runs: list[tuple[int, int]]) -> None:
    assert copy_runs(slots, max_gap) == runs


def test_copy_rows_refreshes_the_used_rows_and_not_far_ones() -> None:
    """The device copy (here a second CPU tensor) gets every used row; a row far from all of them
    keeps what it held (it is never copied: a few requests in far-apart slots copy little)."""
    masks = GrammarMasks(
        max_reqs=4096, vocab_size=32 * 256, device=torch.device("cpu"), fused=False
    )
    masks.bitmask = torch.randint(-(2**31), 2**31 - 1, (4096, 256), dtype=torch.int32)
    masks._on_device = torch.zeros_like(masks.bitmask)  # poisoned "device" rows
    slots = [7, 3, 4000, 5]
    got = masks._copy_rows(slots)
    assert torch.equal(got[slots], masks.bitmask[slots])
    assert got[2000].eq(0).all()  # between 7 and 4000, far from both: not copied


def test_apply_masks_each_logit_row_by_its_requests_slot() -> None:
    """CPU: the masked logits rows read the rows of their slots, the others stay untouched."""
    vocab = 70
    masks = GrammarMasks(max_reqs=8, vocab_size=vocab, device=torch.device("cpu"), fused=False)
    masks.bitmask = torch.randint(-(2**31), 2**31 - 1, (8, 3), dtype=torch.int32)

    class R:
        def __init__(self, row: int) -> None:
            self.row, self.grammar, self.finished = row, object(), False

    reqs = [R(6), R(1), R(3)]
    logits = torch.randn(3, vocab)
    want = logits.clone()
    # batch index 0 samples at logits row 0 and 2 at row 2, with slots 6 and 3; 1 is unmasked
    apply_bitmask(want, masks.bitmask[[6, 3]], rows=torch.tensor([0, 2]))
    masks.apply(reqs, [0, 1, 2], [0, 2], logits)  # type: ignore[arg-type]
    assert torch.equal(logits, want)
    assert masks.stats() == {"count": 0}  # no fill counted: apply alone adds no fill
