"""The multi-LoRA kernels (kernels/lora.py) on CPU under TRITON_INTERPRET=1 against lora_ref:
mixed batches of several adapters and base-model tokens, ranks below the pool's, fused slices."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # kernels/ loaded by path as this package (test_kernels did it on import)
    lora: Any = importlib.import_module("_weft_kernels_interpreted.lora")
    lora_ref: Any = importlib.import_module("_weft_kernels_interpreted.lora_ref")


def _pool(
    slots: int, max_rank: int, ranks: list[int], in_dim: int, widths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A [slots, S * R, in], B [slots, out, R] with NaN past each slot's rank (never read),
    scalings, ranks."""
    n = len(widths)
    a = torch.full((slots, n * max_rank, in_dim), NAN)
    b = torch.full((slots, sum(widths), max_rank), NAN)
    for s, r in enumerate(ranks):
        for i in range(n):
            a[s, i * max_rank : i * max_rank + r] = torch.randn(r, in_dim) / in_dim**0.5
        b[s, :, :r] = torch.randn(sum(widths), r) / max(r, 1) ** 0.5
    scalings = torch.rand(slots) + 0.5
    return a.to(dtype), b.to(dtype), scalings, torch.tensor(ranks, dtype=torch.int32)


def _starts(widths: list[int]) -> tuple[int, ...]:
    return tuple(sum(widths[:i]) for i in range(len(widths)))


CASES = [
    # in, slice widths, max rank, slot ranks, token slots (-1: base), dtype
    (32, [48], 16, [4, 8, 16], [0], torch.float32),  # decode bs 1
    (64, [64, 16, 16], 16, [16, 8, 4], [2, -1, 0, 1, 0, 2, -1, 1], torch.float32),  # qkv decode
    (48, [40, 40], 8, [8, 4], [0] * 5 + [-1] * 7 + [1] * 20, torch.float16),  # gate_up extend
    (64, [32, 8, 8], 16, [4, 16, 8, 0], [1] * 3 + [3] * 4 + [0] * 17 + [2] * 9, torch.float16),
    (40, [24], 4, [4, 4], [-1] * 6, torch.float32),  # only base tokens: y untouched
]


@pytest.mark.parametrize("in_dim, widths, max_rank, ranks, slots, dtype", CASES)
@interpreted
def test_lora_forward_matches_reference(
    in_dim: int,
    widths: list[int],
    max_rank: int,
    ranks: list[int],
    slots: list[int],
    dtype: torch.dtype,
) -> None:
    a, b, scalings, rank_t = _pool(len(ranks), max_rank, ranks, in_dim, widths, dtype)
    x = torch.randn(len(slots), in_dim).to(dtype)
    y = torch.randn(len(slots), sum(widths)).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    want = lora_ref.lora_ref(x, y, a, b, scalings, rank_t, token_slots, _starts(widths))
    for block_m in (16, 32):
        index = lora.lora_index(token_slots, len(ranks), block_m)
        got = y.clone()
        out = lora.lora_forward(x, got, a, b, scalings, rank_t, index, _starts(widths))
        assert out is got
        assert_close(got, want.float(), TOL[dtype])
    base = torch.tensor([s < 0 for s in slots])
    assert torch.equal(got[base], y[base])  # the base model's rows are not rewritten


@pytest.mark.parametrize(
    "split_k, block_k, block_n, n_iters",
    [(1, 16, 16, 1), (3, 16, 32, 1), (2, 32, 64, 1), (4, 16, 16, 2)],
)
@interpreted
def test_split_k_and_tiles_straddling_slices(
    split_k: int, block_k: int, block_n: int, n_iters: int
) -> None:
    """An input of 80 (a partial last K step per split), slices of 20 / 12 / 12 columns: N tiles
    of 16 or 32 hold columns of two or three slices; two N tiles per program, the second partial."""
    widths = [20, 12, 12]
    a, b, scalings, ranks = _pool(3, 8, [8, 2, 5], 80, widths, torch.float32)
    x, y = torch.randn(21, 80), torch.randn(21, 44)
    token_slots = torch.randint(-1, 3, (21,), dtype=torch.int32)
    want = lora_ref.lora_ref(x, y, a, b, scalings, ranks, token_slots, _starts(widths))
    index = lora.lora_index(token_slots.long(), 3, 16)
    launch = lora.LoraLaunch(split_k, block_k, block_n, n_iters)
    got = lora.lora_forward(x, y.clone(), a, b, scalings, ranks, index, _starts(widths), launch)
    assert_close(got, want, TOL[torch.float32])


@interpreted
def test_sgmv_segments_equal_per_token_slots_and_strided_x() -> None:
    """Segments of 5, 0, 17 and 3 tokens (adapter 1, 0, base, 1): their per-token slots; x a view
    with a row stride wider than its row."""
    indptr = torch.tensor([0, 5, 5, 22, 25])
    token_slots = lora.segment_token_slots(indptr, torch.tensor([1, 0, -1, 1]), 25)
    assert token_slots.tolist() == [1] * 5 + [-1] * 17 + [1] * 3
    a, b, scalings, ranks = _pool(2, 16, [16, 8], 64, [32], torch.float16)
    x = torch.randn(25, 80).half()[:, 8:72]
    y = torch.randn(25, 32).half()
    want = lora_ref.lora_ref(x, y, a, b, scalings, ranks, token_slots)
    got = lora.lora_forward(
        x, y.clone(), a, b, scalings, ranks, lora.lora_index(token_slots, 2, 16)
    )
    assert_close(got, want.float(), TOL[torch.float16])


@interpreted
def test_lora_index_groups_by_slot_base_last() -> None:
    token_slots = torch.tensor([2, -1, 0, 2, -1, 2], dtype=torch.int32)
    index = lora.lora_index(token_slots, 4, 4)
    # capacity 6 + min(5, 6) * 3 = 21 -> 6 tiles of 4; padding holds T = 6
    assert index.sorted_tokens.shape == (24,) and index.tile_slot.shape == (6,)
    assert index.sorted_tokens.tolist()[:12] == [2, 6, 6, 6, 0, 3, 5, 6, 1, 4, 6, 6]
    assert index.tile_slot.tolist() == [0, 2, -1, -1, -1, -1]
    assert index.padded.tolist() == [12]  # the base model's tile (slot -1) is skipped too


@interpreted
def test_empty_batch_and_bad_inputs() -> None:
    a, b, scalings, ranks = _pool(2, 8, [8, 8], 32, [16], torch.float32)
    empty = torch.zeros(0, dtype=torch.int32)
    y0 = torch.zeros(0, 16)
    out = lora.lora_forward(
        torch.zeros(0, 32), y0, a, b, scalings, ranks, lora.lora_index(empty, 2, 16)
    )
    assert out.shape == (0, 16)
    x, y = torch.randn(3, 32), torch.randn(3, 16)
    index = lora.lora_index(torch.zeros(3, dtype=torch.int32), 2, 16)
    with pytest.raises(AssertionError, match="a: dtype"):
        lora.lora_forward(x, y, a.half(), b, scalings, ranks, index)
    with pytest.raises(AssertionError, match="b: expected shape"):
        lora.lora_forward(x, y, a, b[:, :8], scalings, ranks, index)
    with pytest.raises(AssertionError, match="scalings: dtype"):
        lora.lora_forward(x, y, a, b, scalings.half(), ranks, index)
    with pytest.raises(ValueError, match="power of 2"):
        lora.LoraLaunch(block_n=48)
