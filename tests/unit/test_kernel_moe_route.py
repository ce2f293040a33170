"""The router's top-k kernel (kernels/moe_route.py) on CPU under TRITON_INTERPRET=1 against
moe_ref.select_experts."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # kernels/ loaded by path as this package (test_kernels did it on import)
    route: Any = importlib.import_module("_weft_kernels_interpreted.moe_route")
    moe_ref: Any = importlib.import_module("_weft_kernels_interpreted.moe_ref")


@interpreted
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "dtype"),
    [
        (1, 128, 8, True, torch.bfloat16),  # Qwen3-30B-A3B
        (5, 8, 2, True, torch.float32),  # Mixtral
        (3, 60, 4, False, torch.float16),  # E not a power of two, plain softmax weights
        (2, 1, 1, True, torch.float32),  # one expert
        (4, 16, 16, False, torch.float32),  # every expert chosen
    ],
)
def test_route_topk_matches_select_experts(
    tokens: int, experts: int, top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    # distinct logits, exact in every dtype (eighths below 64): no tie for torch.topk to order
    logits = torch.stack([torch.randperm(experts) for _ in range(tokens)]).sub(experts / 2)
    logits = logits.div(8).to(dtype)
    weights, ids = route.route_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_ref.select_experts(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@interpreted
def test_route_topk_breaks_ties_to_the_lower_id_and_reads_a_strided_view() -> None:
    logits = torch.zeros(2, 12)
    logits[0, [3, 7, 9]] = 1.0  # three equal maxima, then ties among the zeros
    wide = torch.randn(2, 20)
    wide[:, :12] = logits
    weights, ids = route.route_topk(wide[:, :12], 4, True)
    assert ids.tolist() == [[3, 7, 9, 0], [0, 1, 2, 3]]
    ref_weights, _ = moe_ref.select_experts(logits, 4, True)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@interpreted
def test_route_topk_refuses_a_top_k_out_of_range_and_takes_no_tokens() -> None:
    with pytest.raises(ValueError, match="top_k must be in"):
        route.route_topk(torch.randn(2, 4), 5, True)
    weights, ids = route.route_topk(torch.randn(0, 4), 2, True)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
