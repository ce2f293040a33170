"""The fused MoE kernel and the router's top-k kernel on CUDA at Qwen3-30B-A3B's and Mixtral-8x7B's shapes against moe_ref, and
inside a CUDA graph whose replays route differently. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

from weft.kernels.moe import fused_moe  # noqa: E402
from weft.kernels.moe_ref import moe_ref, select_experts  # noqa: E402
from weft.kernels.moe_route import route_topk  # noqa: E402

DEV = "cuda"
# name: experts, top_k, hidden, intermediate
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _weights(experts: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(experts, 2 * inter, hidden, device=DEV).div_(hidden**0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, device=DEV).div_(inter**0.5).bfloat16()
    return w13, w2


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each shape's bf16 weights, made once (Mixtral's are 2.8 GB)."""
    return {name: _weights(e, h, i) for name, (e, _, h, i) in SHAPES.items()}


def _route(tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts(torch.randn(tokens, experts, device=DEV), top_k, True)


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_moe_bf16_at_real_shapes(
    shape: str, tokens: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    experts, top_k, hidden, _ = SHAPES[shape]
    w13, w2 = weights[shape]
    x = torch.randn(tokens, hidden, device=DEV).bfloat16()
    topk_weights, topk_ids = _route(tokens, experts, top_k)
    out = torch.full_like(x, float("nan"))
    fused_moe(x, w13, w2, topk_weights, topk_ids, out=out)
    assert not out.isnan().any()
    err = rel_err(out, moe_ref(x, w13, w2, topk_weights, topk_ids))
    assert err < 1e-2, f"{shape} T={tokens}: relative error {err:.3g}"


def test_all_tokens_on_one_expert_and_float16() -> None:
    """Every token on experts 5 and 6 of 8 (long runs, several M blocks each), in float16."""
    w13, w2 = (w.half() for w in _weights(8, 1024, 512))
    x = torch.randn(300, 1024, device=DEV).half()
    ids = torch.tensor([[5, 6]], device=DEV).expand(300, 2).int()
    topk_weights = torch.rand(300, 2, device=DEV)
    out = fused_moe(x, w13, w2, topk_weights, ids)
    assert rel_err(out, moe_ref(x, w13, w2, topk_weights, ids)) < 3e-3


@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_moe_in_a_cuda_graph(
    tokens: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Captured once: the alignment runs on the device with no host read, so each replay with
    new routing (copied into the captured inputs) equals the reference for that routing."""
    experts, top_k, hidden, _ = SHAPES["qwen3-30b-a3b"]
    w13, w2 = weights["qwen3-30b-a3b"]
    x = torch.randn(tokens, hidden, device=DEV).bfloat16()
    topk_weights, topk_ids = _route(tokens, experts, top_k)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        fused_moe(x, w13, w2, topk_weights, topk_ids, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, topk_weights, topk_ids, out=out)
    for _ in range(3):
        new_weights, new_ids = _route(tokens, experts, top_k)
        x.copy_(torch.randn_like(x))
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        err = rel_err(out, moe_ref(x, w13, w2, topk_weights, topk_ids))
        assert err < 1e-2, f"replay T={tokens}: relative error {err:.3g}"


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_route_topk_matches_select_experts(name: str, tokens: int) -> None:
    experts, top_k, _, _ = SHAPES[name]
    logits = torch.randn(tokens, experts, device=DEV)  # float32: ties are improbable
    weights, ids = route_topk(logits, top_k, True)
    ref_weights, ref_ids = select_experts(logits, top_k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    # bf16 logits tie often among 128 experts, and torch.topk orders ties as it likes on CUDA:
    # the chosen weights agree as sorted values, each id's logit is one of the top_k largest
    logits = logits.mul(2).bfloat16()
    weights, ids = route_topk(logits, top_k, True)
    ref_weights, _ = select_experts(logits, top_k, True)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    kth = logits.float().topk(top_k, dim=-1).values[:, -1:]
    assert (logits.float().gather(1, ids.long()) >= kth).all()
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "an expert chosen twice"
