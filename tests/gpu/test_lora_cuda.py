"""The multi-LoRA kernels on CUDA at Llama-3-8B's projection shapes against lora_ref: decode and
prefill batches mixing 8 adapters of ranks 4-16 with base-model tokens, and inside a CUDA graph
whose replays route tokens to other adapters. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

from weft.kernels.lora import lora_forward, lora_index, segment_token_slots  # noqa: E402
from weft.kernels.lora_ref import lora_ref  # noqa: E402

DEV = "cuda"
MAX_RANK, SLOTS = 16, 8
# name: in, slice widths (Llama-3-8B: 32 q / 8 kv heads of 128, MLP 14336)
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,)), "o": (4096, (4096,))}  # fmt: skip


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _pool(in_dim: int, widths: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """SLOTS adapters of ranks 16, 8, 4, ... (zero padded), scalings around 1."""
    ranks = torch.tensor([16, 8, 4, 16, 12, 16, 8, 4], dtype=torch.int32, device=DEV)
    a = torch.randn(SLOTS, len(widths) * MAX_RANK, in_dim, device=DEV) / in_dim**0.5
    b = torch.randn(SLOTS, sum(widths), MAX_RANK, device=DEV) / MAX_RANK**0.5
    keep = torch.arange(MAX_RANK, device=DEV)[None, :] < ranks[:, None]  # [slots, R]
    a *= keep.repeat(1, len(widths))[:, :, None]
    b *= keep[:, None, :]
    scalings = torch.rand(SLOTS, device=DEV) + 0.5
    return a.to(dtype), b.to(dtype), scalings, ranks


def _starts(widths: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sum(widths[:i]) for i in range(len(widths)))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lora_forward_at_8b_shapes(shape: str, tokens: int, dtype: torch.dtype) -> None:
    in_dim, widths = SHAPES[shape]
    a, b, scalings, ranks = _pool(in_dim, widths, dtype)
    x = torch.randn(tokens, in_dim, device=DEV).to(dtype)
    y = torch.zeros(tokens, sum(widths), device=DEV, dtype=dtype)  # the delta alone is compared
    slots = torch.randint(-1, SLOTS, (tokens,), device=DEV, dtype=torch.int32)
    if tokens == 1:
        slots.fill_(3)
    want = lora_ref(x, y, a, b, scalings, ranks, slots, _starts(widths))
    index = lora_index(slots, SLOTS, 16 if tokens <= 128 else 64)
    got = lora_forward(x, y.clone(), a, b, scalings, ranks, index, _starts(widths))
    err = rel_err(got, want)
    assert err < 1e-2, f"{shape} T={tokens}: relative error {err:.3g}"
    assert not got[slots < 0].any(), "base-model tokens got a delta"


def test_sgmv_segments_at_prefill() -> None:
    """Eight requests of 1..600 tokens (one of them the base model) as segments."""
    in_dim, widths = SHAPES["qkv"]
    a, b, scalings, ranks = _pool(in_dim, widths, torch.bfloat16)
    lens = torch.tensor([600, 1, 37, 255, 16, 300, 2, 128], device=DEV)
    indptr = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
    seg_slots = torch.tensor([0, 5, -1, 2, 7, 2, 1, 3], device=DEV)
    tokens = int(lens.sum())
    slots = segment_token_slots(indptr, seg_slots, tokens)
    x = torch.randn(tokens, in_dim, device=DEV).bfloat16()
    y = torch.randn(tokens, sum(widths), device=DEV).bfloat16()
    want = lora_ref(x, y, a, b, scalings, ranks, slots, _starts(widths))
    got = lora_forward(x, y.clone(), a, b, scalings, ranks, lora_index(slots, SLOTS, 64),
                       _starts(widths))  # fmt: skip
    assert rel_err(got - y, want - y) < 2e-2


def test_decode_in_a_cuda_graph_follows_new_slots() -> None:
    """The index and both kernels captured once for bs 64; each replay routes tokens anew."""
    in_dim, widths = SHAPES["qkv"]
    a, b, scalings, ranks = _pool(in_dim, widths, torch.bfloat16)
    x = torch.randn(64, in_dim, device=DEV).bfloat16()
    y0 = torch.randn(64, sum(widths), device=DEV).bfloat16()
    slots = torch.zeros(64, dtype=torch.int32, device=DEV)
    y = y0.clone()

    def step() -> None:
        y.copy_(y0)
        lora_forward(x, y, a, b, scalings, ranks, lora_index(slots, SLOTS, 16), _starts(widths))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        slots.copy_(torch.randint(-1, SLOTS, (64,), device=DEV, dtype=torch.int32))
        graph.replay()
        want = lora_ref(x, y0, a, b, scalings, ranks, slots, _starts(widths))
        assert rel_err(y - y0, want - y0) < 2e-2
