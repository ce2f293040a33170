"""GGUF blocks on CUDA at real sizes (Qwen2.5-Coder-1.5B's projections and lm_head): the Triton
dequantizing matmul at 1-64 rows and the tile dequantizer against the torch dequantizer (itself
bit-exact with gguf-py: tests/unit/test_kernel_gguf.py), every type; a kept-quantized model in
bf16 against the same weights dequantized; an engine replaying decode from CUDA graphs gives the
eager greedy tokens; Q4_K_M weights take under a third of bf16's memory. Skipped without CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
QWEN_15B = REPO / "benchmarks/configs/qwen2.5-coder-1.5b"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
SHAPES = [(1536, 1536), (256, 1536), (17920, 1536), (1536, 8960)]  # q, k|v, gate_up, down


def _ids() -> dict[str, int]:
    from weft.kernels import gguf as kgguf

    return {t.name: t.ggml_id for t in kgguf.TYPES.values()}


@pytest.mark.parametrize("name", TYPES)
def test_matmul_and_dequantize_at_real_shapes(name: str) -> None:
    from weft.kernels import gguf as kgguf
    from weft.kernels.gguf_gemv import dequantize, matmul
    from weft.runtime.models.quant.gguf import _dense

    ggml_id = _ids()[name]
    gen = torch.Generator(device="cuda").manual_seed(ggml_id)
    for n, k in SHAPES:
        blocks = kgguf.random_blocks(ggml_id, n, k, gen, "cuda")
        w = kgguf.dequantize(blocks, ggml_id, k)  # float32, bit-exact with gguf-py
        # the Triton tile dequantizer: the same values up to FMA contraction
        torch.testing.assert_close(dequantize(blocks, ggml_id, k, torch.float32), w,
                                   rtol=1e-6, atol=1e-8)  # fmt: skip
        assert torch.equal(dequantize(blocks, ggml_id, k, torch.bfloat16), w.bfloat16())
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for rows in (1, 7, 16, 32, 64):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            out = matmul(x, blocks, ggml_id, bias)
            want = x.float() @ w.bfloat16().float().T + bias.float()
            err = ((out.float() - want).norm() / want.norm()).item()
            assert err < 5e-3, f"{name} [{n} x {k}] rows {rows}: relative error {err:.3g}"
        # prefill: dense GEMMs over dequantized chunks of rows (gate_up: two chunks)
        x = torch.randn(100, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.bfloat16().float().T + bias.float()
        err = ((_dense(x, blocks, ggml_id, bias).float() - want).norm() / want.norm()).item()
        assert err < 5e-3, f"{name} [{n} x {k}] dense: relative error {err:.3g}"


def test_lm_head_q6_k() -> None:
    """The largest matrix: 151936 x 1536 Q6_K (191 MB of blocks), at 1 and 64 rows."""
    from weft.kernels import gguf as kgguf
    from weft.kernels.gguf_gemv import matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = kgguf.random_blocks(14, 151936, 1536, gen, "cuda")
    w = kgguf.dequantize(blocks, 14, 1536).bfloat16().float()
    for rows in (1, 64):
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.T
        err = ((matmul(x, blocks, 14).float() - want).norm() / want.norm()).item()
        assert err < 5e-3, f"rows {rows}: relative error {err:.3g}"


def test_model_in_bf16_matches_the_dequantized_weights() -> None:
    """Every type in one small model (tests/unit/test_gguf_models.py's layout), on CUDA in
    bf16: decode-sized inputs run the Triton matmul, prefill-sized ones the dense GEMM over
    dequantized tiles; both against the dense model of the same weights."""
    import sys

    sys.path.insert(0, str(REPO / "tests/unit"))
    from test_gguf_models import config, every_type

    from weft.runtime.loader.gguf_tensors import BlockTensor
    from weft.runtime.models import build_model
    from weft.runtime.models.layers import Projection
    from weft.runtime.models.quant.gguf import GGUFQuantConfig
    from weft.runtime.models.weights import dummy_weights

    cfg = config(False)
    quant = GGUFQuantConfig(every_type(cfg), cfg)
    dev = torch.device("cuda")
    model = build_model(cfg, 64, dev, torch.bfloat16, quant=quant)
    ckpt = list(dummy_weights(model.checkpoint_shapes(), 1, dev, torch.bfloat16, 0.02, quant))
    model.load_weights(ckpt)
    dense = build_model(cfg, 64, dev, torch.bfloat16)
    dense.load_weights((n, t.read(-1, 0, 0) if isinstance(t, BlockTensor) else t) for n, t in ckpt)
    pairs = zip([m for m in model.modules() if isinstance(m, Projection)],
                [m for m in dense.modules() if isinstance(m, Projection)], strict=True)  # fmt: skip
    for q, d in pairs:
        for rows in (1, 33, 200):  # the GEMV path, its 64-row tiles, the dense GEMM
            x = torch.randn(rows, d.in_features, device=dev, dtype=torch.bfloat16)
            want = d(x).float()
            err = ((q(x).float() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{type(q.quant).__name__} rows {rows}: error {err:.3g}"
    ids = torch.tensor([0, 17, 299], device=dev)
    assert torch.equal(model.embed_tokens(ids), dense.embed_tokens(ids))


def test_engine_graphs_give_the_eager_tokens_and_a_quarter_of_the_memory() -> None:
    import weft

    kwargs = {"model": str(QWEN_15B), "load_format": "dummy", "quantization": "gguf",
              "skip_tokenizer_init": True, "max_total_tokens": 8192, "context_length": 1024,
              "max_running_requests": 8}  # fmt: skip
    prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 90, 17))]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    tokens = []
    for eager in (False, True):  # the 90-token prompt prefills through the dense GEMM
        with weft.Engine(**kwargs, disable_cuda_graph=eager) as eng:
            outs = eng.generate(None, params, input_ids=prompts)
            assert isinstance(outs, list)
            tokens.append([o["output_ids"] for o in outs])
    assert tokens[0] == tokens[1]

    from weft.runtime.loader import read_hf_config
    from weft.runtime.models import build_model, init_dummy_weights
    from weft.runtime.models.quant.gguf import GGUFQuantConfig, q4_k_m_types

    hf = read_hf_config(QWEN_15B)
    before = torch.cuda.memory_allocated()
    quant = GGUFQuantConfig(q4_k_m_types(hf), hf)
    model = build_model(hf, 1024, torch.device("cuda"), torch.bfloat16, quant=quant)
    init_dummy_weights(model, 0, quant=quant)
    kept = torch.cuda.memory_allocated() - before
    bf16 = sum(math.prod(shape) for _, shape in model.checkpoint_shapes()) * 2
    print(
        f"\nQwen2.5-Coder-1.5B Q4_K_M weights: {kept / 2**20:.0f} MiB kept quantized, "
        f"{bf16 / 2**20:.0f} MiB in bf16 ({kept / bf16:.2f})"
    )
    assert kept < 0.33 * bf16
