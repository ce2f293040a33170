"""The fused MoE kernel (kernels/moe.py) on CPU under TRITON_INTERPRET=1 against moe_ref."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # kernels/ loaded by path as this package (test_kernels did it on import)
    moe: Any = importlib.import_module("_weft_kernels_interpreted.moe")
    moe_ref: Any = importlib.import_module("_weft_kernels_interpreted.moe_ref")


def _weights(
    experts: int, hidden: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    return w13, w2


def _route(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router weights and ids of random logits, expert 1 never chosen (an expert without pairs)."""
    logits = torch.randn(tokens, experts)
    logits[:, 1] = -1e9
    return moe_ref.select_experts(logits, top_k, True)


# float32 and float16: the interpreter's bfloat16 dots are wrong (tests/gpu/test_moe_cuda.py
# runs bfloat16), as in test_kernel_gemv.py
CASES = [
    # experts, top_k, hidden, intermediate, tokens, dtype
    (4, 1, 32, 32, 1, torch.float32),
    (4, 2, 64, 48, 3, torch.float32),  # I = 48: not a multiple of the N tile
    (8, 2, 32, 64, 17, torch.float32),
    (8, 1, 64, 40, 17, torch.float16),
    (8, 2, 48, 32, 3, torch.float16),  # H = 48: a partial K step and N tile in the down GEMM
    (4, 2, 64, 64, 17, torch.float16),
]


@pytest.mark.parametrize("experts, top_k, hidden, inter, tokens, dtype", CASES)
@interpreted
def test_fused_moe_matches_reference(
    experts: int, top_k: int, hidden: int, inter: int, tokens: int, dtype: torch.dtype
) -> None:
    x = torch.randn(tokens, hidden).to(dtype)
    w13, w2 = _weights(experts, hidden, inter, dtype)
    weights, ids = _route(tokens, experts, top_k)
    out = torch.full((tokens, hidden), NAN, dtype=dtype)
    assert moe.fused_moe(x, w13, w2, weights, ids, out=out) is out
    assert_close(out, moe_ref.moe_ref(x, w13, w2, weights, ids).float(), TOL[dtype])


@pytest.mark.parametrize("block_m, slots", [(16, [3]), (16, [3, 2]), (32, [3, 2])])
@interpreted
def test_all_tokens_on_one_expert_span_several_m_blocks(block_m: int, slots: list[int]) -> None:
    """17 tokens all on expert 3 (and with K = 2 also on expert 2): 17 pairs per expert over two
    M blocks of 16 (the second mostly padding) or one of 32; experts 0 and 1 get none. An N tile
    of 16 leaves I = 40 a partial last tile."""
    x, (w13, w2) = torch.randn(17, 32), _weights(4, 32, 40, torch.float32)
    ids = torch.tensor([slots] * 17, dtype=torch.int32)
    weights = torch.rand(17, len(slots))
    launch = moe.MoeLaunch(block_m=block_m, block_n=16, block_k=16)
    out = moe.fused_moe(x, w13, w2, weights, ids, launch=launch)
    assert_close(out, moe_ref.moe_ref(x, w13, w2, weights, ids), TOL[torch.float32])


@interpreted
def test_int64_ids_strided_x_and_float16() -> None:
    rows = torch.randn(3, 80).half()
    x = rows[:, 8:72]  # a row stride wider than the row
    w13, w2 = _weights(8, 64, 32, torch.float16)
    weights, ids = _route(3, 8, 2)
    out = moe.fused_moe(x, w13, w2, weights.half(), ids.long())
    assert_close(out, moe_ref.moe_ref(x, w13, w2, weights, ids).float(), TOL[torch.float16] * 3)


@interpreted
def test_align_pairs_groups_by_expert_and_pads() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)  # pairs 0..5; expert 1 empty
    align = moe.align_pairs(ids, 4, 16)
    # capacity T*K + min(E, T*K) * (block_m - 1) = 66, rounded up to 5 blocks of 16
    assert align.sorted_ids.shape == (80,) and align.block_expert.shape == (5,)
    assert align.padded.tolist() == [48]
    sorted_ids = align.sorted_ids.tolist()
    assert sorted_ids[0:16] == [1, 4] + [6] * 14  # expert 0's pairs, then padding (= T*K)
    assert sorted_ids[16:32] == [0, 2, 5] + [6] * 13  # expert 2's: pairs 0, 2, 5
    assert sorted_ids[32:48] == [3] + [6] * 15  # expert 3's
    assert sorted_ids[48:] == [6] * 32  # idle blocks past the padded count
    assert align.block_expert.tolist()[:3] == [0, 2, 3]


ALIGN_CASES = [
    # tokens, top_k, experts, block_m, routing, id dtype
    (1, 8, 128, 16, "random", torch.int32),  # Qwen3-30B-A3B decode
    (1, 1, 8, 16, "random", torch.int32),  # a single pair
    (3, 2, 60, 32, "random", torch.int64),  # E not a power of 2, int64 ids
    (5, 1, 1, 16, "random", torch.int32),  # E = 1
    (17, 2, 8, 16, "one", torch.int64),  # every pair on one expert: two M blocks of it
    (24, 8, 60, 16, "all", torch.int32),  # every expert holds pairs
    (9, 2, 8, 64, "random", torch.int32),  # block_m 64: most of each block padding
    (128, 8, 128, 16, "random", torch.int32),  # FUSED_ALIGN_MAX_PAIRS: several chunks of pairs
]


@pytest.mark.parametrize("tokens, top_k, experts, block_m, routing, dtype", ALIGN_CASES)
@interpreted
def test_fused_align_equals_torch_align(
    tokens: int, top_k: int, experts: int, block_m: int, routing: str, dtype: torch.dtype
) -> None:
    """_align_kernel (align_pairs at decode sizes on a GPU) gives the torch path's alignment bit
    for bit."""
    pairs = tokens * top_k
    assert pairs <= moe.FUSED_ALIGN_MAX_PAIRS  # (the sizes align_pairs runs it at)
    if routing == "one":
        ids = torch.full((tokens, top_k), experts - 3)
    elif routing == "all":
        ids = (torch.arange(pairs) % experts)[torch.randperm(pairs)].view(tokens, top_k)
    else:
        ids = torch.randint(0, experts, (tokens, top_k))
    ids = ids.to(dtype)
    fused = moe._align_pairs_fused(ids, experts, block_m)
    torch_ = moe._align_pairs_torch(ids, experts, block_m)
    for name, got, want in zip(moe.MoeAlignment._fields, fused, torch_, strict=True):
        assert got.dtype == want.dtype == torch.int32, f"{name}: {got.dtype}, {want.dtype}"
        assert torch.equal(got, want), f"{name}:\n{got.tolist()}\n!= {want.tolist()}"


@interpreted
def test_no_tokens_and_bad_inputs() -> None:
    w13, w2 = _weights(4, 32, 32, torch.float32)
    empty = moe.fused_moe(torch.randn(0, 32), w13, w2, torch.ones(0, 2), torch.zeros(0, 2).int())
    assert empty.shape == (0, 32)
    x, weights, ids = torch.randn(2, 32), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="w2: expected shape"):
        moe.fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(AssertionError, match="w13: dtype"):
        moe.fused_moe(x, w13.half(), w2, weights, ids)
    with pytest.raises(AssertionError, match="topk_weights: expected shape"):
        moe.fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(AssertionError, match="topk_ids: dtype"):
        moe.fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="power of 2"):
        moe.MoeLaunch(block_m=24)


@interpreted
def test_default_launch_grows_block_m_with_pairs_per_expert() -> None:
    default_launch = moe.default_launch
    assert default_launch(1, 2048, 768, 8, 128).block_m == 16
    assert default_launch(512, 2048, 768, 8, 128).block_m == 32
    assert default_launch(4096, 4096, 14336, 2, 8).block_m == 64
