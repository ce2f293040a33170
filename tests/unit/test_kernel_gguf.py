"""GGUF block kernels against references built on gguf-py's dequantizers, per quant type with
random blocks: the torch dequantizer / matmul / row lookup (kernels/gguf.py, exact), and the
Triton dequantizing matmul and tile dequantizer (kernels/gguf_gemv.py) under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_kernels import INTERPRETING

from weft.kernels import gguf as kgguf

interpreted = test_kernels.interpreted_in(__file__)
if INTERPRETING:  # kernels/ loaded by path as its own package (test_kernels)
    kt: Any = importlib.import_module("_weft_kernels_interpreted.gguf_gemv")

TYPES = {t.name: t.ggml_id for t in kgguf.TYPES.values()}
# K per type: several blocks, and for the 32-weight types a count of blocks that the default
# 4-block tile does not divide (the kernel then walks one block at a time)
K = {name: (512 if name.endswith("_K") else 224) for name in TYPES}


def reference(blocks: torch.Tensor, ggml_id: int) -> torch.Tensor:
    """gguf-py's dequantization of [rows, row_bytes] blocks: float32 [rows, K]."""
    out = gguf_dequantize(blocks.cpu().numpy(), GGMLQuantizationType(ggml_id))
    return torch.from_numpy(np.ascontiguousarray(out))


@pytest.mark.parametrize("name", TYPES)
def test_torch_dequantize_is_gguf_py_bit_for_bit(name: str) -> None:
    ggml_id, k = TYPES[name], K[name]
    gen = torch.Generator().manual_seed(ggml_id)
    blocks = kgguf.random_blocks(ggml_id, 7, k, gen)
    assert torch.equal(kgguf.dequantize(blocks, ggml_id, k), reference(blocks, ggml_id))
    # any bytes at all (infinite / NaN scales included) decode as gguf-py decodes them
    raw = torch.randint(0, 256, blocks.shape, generator=gen, dtype=torch.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference(raw, ggml_id)
    assert torch.equal(kgguf.dequantize(raw, ggml_id, k).nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("name", TYPES)
def test_torch_linear_and_embedding(name: str) -> None:
    ggml_id, k = TYPES[name], K[name]
    gen = torch.Generator().manual_seed(ggml_id)
    blocks = kgguf.random_blocks(ggml_id, 45, k, gen)
    w = reference(blocks, ggml_id)
    x, bias = torch.randn(3, k, generator=gen), torch.randn(45, generator=gen)
    out = kgguf.linear(x, blocks, ggml_id, bias, chunk_rows=16)  # 3 chunks, the last short
    torch.testing.assert_close(out, x @ w.T + bias, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([44, 0, 7, 7])
    assert torch.equal(kgguf.embedding(ids, blocks, ggml_id, k, torch.float32), w[ids])


def test_block_sizes_match_gguf_py_and_bad_rows_are_named() -> None:
    from gguf import GGML_QUANT_SIZES

    for t in kgguf.TYPES.values():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_id)] == (t.block, t.nbytes), t.name
    with pytest.raises(ValueError, match="Q4_K rows hold whole blocks of 256; K=100"):
        kgguf.dequantize(torch.zeros(1, 144, dtype=torch.uint8), 12, 100)
    with pytest.raises(ValueError, match="ggml type 10 is not kept quantized"):
        kgguf.block_type(10)  # Q2_K


# rows, n, launch (block_n, split_k, num_warps, legacy_blocks), bias
MATMUL_CASES = [
    (1, 40, (16, 1, 4, 4), False),  # masked rows of W, one K slice
    (3, 32, (16, 2, 4, 1), True),  # split K (partials summed by torch), bias
    (20, 24, (16, 0, 2, 2), True),  # 32 rows of x per tile, the automatic split
]


@pytest.mark.parametrize("name", TYPES)
@interpreted
def test_triton_matmul(name: str) -> None:
    ggml_id, k = TYPES[name], K[name]
    gen = torch.Generator().manual_seed(ggml_id)
    for rows, n, launch, with_bias in MATMUL_CASES:
        blocks = kgguf.random_blocks(ggml_id, n, k, gen)
        w = reference(blocks, ggml_id)
        x = torch.randn(rows, k, generator=gen)
        bias = torch.randn(n, generator=gen) if with_bias else None
        wide = torch.full((rows, n + 8), float("nan"))  # out: a column slice of a wider matrix
        out = kt.matmul(x, blocks, ggml_id, bias, out=wide[:, 4 : 4 + n],
                        launch=kt.GGUFLaunch(*launch))  # fmt: skip
        expected = x @ w.T + (bias if bias is not None else 0)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=f"{rows} {launch}")
        assert wide[:, :4].isnan().all() and wide[:, 4 + n :].isnan().all()
    half = torch.randn(2, k, generator=gen).half()  # a half x: the dot in half, float32 sums
    blocks = kgguf.random_blocks(ggml_id, 16, k, gen)
    expected = half.float() @ reference(blocks, ggml_id).half().float().T
    out = kt.matmul(half, blocks, ggml_id)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", TYPES)
@interpreted
def test_triton_dequantize(name: str) -> None:
    ggml_id, k = TYPES[name], K[name]
    blocks = kgguf.random_blocks(ggml_id, 40, k, torch.Generator().manual_seed(ggml_id))
    out = kt.dequantize(blocks, ggml_id, k, torch.float32)
    torch.testing.assert_close(out, reference(blocks, ggml_id), rtol=1e-6, atol=1e-7)


@interpreted
def test_triton_matmul_refuses_what_it_cannot_serve() -> None:
    blocks = kgguf.random_blocks(12, 16, 256)
    with pytest.raises(ValueError, match="serves 1..64 rows, got 65"):
        kt.matmul(torch.zeros(65, 256), blocks, 12)
    with pytest.raises(ValueError, match="split_k must be >= 0"):
        kt.GGUFLaunch(split_k=-1)
