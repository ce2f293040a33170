"""FP8 on CUDA (compute capability 8.9+): the compiled quantization kernel bit for bit against torch,
the FP8 GEMV and the row-wise _scaled_mm against their float32 references at Llama-3.1-8B shapes,
the quant method's two paths, FlashInfer and Triton over an fp8 KV pool against the torch backend,
and an FP8 engine (CUDA graphs) against its bf16 twin. Skipped without such a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+ (fp8)",
)

FP8 = torch.float8_e4m3fn
SHAPES_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
             "down": (4096, 14336)}  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_activations_equals_torch_bit_for_bit(silu_mul: bool, static: bool) -> None:
    from weft.kernels.fp8 import quantize_activations, quantize_per_token_ref, quantize_static_ref

    torch.manual_seed(0)
    x = (torch.randn(300, 2 * 4096 if silu_mul else 4096, device="cuda") * 2).bfloat16()
    scale_in = torch.tensor(0.02, device="cuda") if static else None
    q, scale = quantize_activations(x, scale_in, silu_mul=silu_mul)
    if static:
        assert scale_in is not None
        q_ref, s_ref = quantize_static_ref(x, scale_in, silu_mul), scale_in.expand(300, 1)
    else:
        q_ref, s_ref = quantize_per_token_ref(x, silu_mul)
    torch.testing.assert_close(scale, s_ref.float(), rtol=1e-6, atol=0)
    if silu_mul:  # sigmoid differs in the last bits between Triton and torch: rare 1-step flips
        assert (q.float() != q_ref.float()).float().mean().item() < 1e-3
    else:
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 32])
@pytest.mark.parametrize("shape", list(SHAPES_8B))
def test_fp8_gemv_bf16_at_8b_shapes(shape: str, rows: int) -> None:
    from weft.kernels.fp8 import quantize_per_channel
    from weft.kernels.fp8_gemv import fp8_gemv, fp8_gemv_ref

    torch.manual_seed(0)
    n, k = SHAPES_8B[shape]
    w, scale = quantize_per_channel(torch.randn(n, k, device="cuda") / k**0.5)
    silu = shape == "down"
    x = torch.randn(rows, 2 * k if silu else k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16() if shape == "qkv" else None
    out = fp8_gemv(x, w, scale, bias, silu_mul=silu)
    assert rel_err(out, fp8_gemv_ref(x, w, scale, bias, silu)) < 1e-2


@pytest.mark.parametrize("tokens", [33, 64, 1000])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_row_wise_matches_the_reference(tokens: int, static: bool) -> None:
    from weft.kernels.fp8 import (
        fp8_linear_ref,
        quantize_activations,
        quantize_per_channel,
        scaled_mm,
    )

    torch.manual_seed(0)
    n, k = SHAPES_8B["qkv"]
    w, scale = quantize_per_channel(torch.randn(n, k, device="cuda") / k**0.5)
    x = torch.randn(tokens, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    input_scale = x.abs().amax().float().reshape(()) / 448 if static else None
    xq, xs = quantize_activations(x, input_scale)
    out = scaled_mm(xq, xs, w, scale, bias, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, n)
    assert rel_err(out, fp8_linear_ref(x, w, scale, bias, input_scale)) < 1e-2


def test_fp8_method_gemv_and_gemm_paths_agree_with_the_torch_path() -> None:
    """A quantized Projection on CUDA: 1-32 rows through the GEMV (W8A16), more through
    _scaled_mm (W8A8); each near the torch W8A8 path's result on the CPU."""
    from weft.runtime.loader.fp8_checkpoint import Fp8Scheme
    from weft.runtime.models.layers import Projection
    from weft.runtime.models.quant.base import attach
    from weft.runtime.models.quant.fp8 import Fp8Method
    from weft.runtime.models.weights import Placement

    torch.manual_seed(0)
    with torch.device("meta"):
        layer = Projection(4096, 1024, bias=True)
        attach(layer, Fp8Method(Fp8Scheme()), 1024, 4096)
    layer = layer.to_empty(device="cuda")
    layer.bias = torch.nn.Parameter(torch.randn(1024, device="cuda").bfloat16())
    assert layer.weight.dtype == FP8
    assert layer.quant is not None
    layer.quant.load(layer, "weight", "", torch.randn(1024, 4096, device="cuda") / 64,
                     Placement((1024, 4096)))  # fmt: skip
    layer.quant.finish(layer)
    cpu = {k: v.cpu() for k, v in layer.state_dict().items()}
    for rows in (1, 32, 33, 512):
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        with torch.no_grad():
            got = layer(x)
            want = layer.quant.apply(_cpu_layer(layer, cpu), x.cpu().float(), cpu["bias"].float())
        assert rel_err(got.cpu(), want) < 2e-2, rows


def _cpu_layer(layer: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    holder = torch.nn.Module()
    for name in ("weight", "weight_scale"):
        holder.register_buffer(name, state[name])
    return holder


FP8_BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_fp8_kv_pool_backends_match_the_torch_backend(backend: str, page_size: int) -> None:
    """kv_cache_dtype fp8_e4m3: each CUDA backend over an fp8 pool gives the torch backend's
    logits over the same fp8 pool (prefill chunks over cached prefixes, a mixed step, decode).
    Every backend attends to all keys as the pool holds them, the step's new ones too (issue 40:
    triton's extend read those fresh in bf16, 0.46 off at logit scale 5.2 in the first chunk).
    NOTE: the bound is 3% of the logit scale (the bf16 test's 2%): a last-bit difference between
    two backends' layer-0 outputs moves layer 1's keys across an e4m3 rounding step (6%). On CPU
    (triton interpreted, fp16 dots) the torch/triton gap over this schedule's fp8 pool was 0.098 at
    scale 5.0 with 2 layers, 0.047 with 1; over an fp16 pool 0.007, over fp8 0.036 (fp16 model).
    It still tells an fp8 pool from a bf16 one: the torch backend's logits over the two differ by
    more than the bound at every step (0.32-0.45 on CPU)."""
    from test_attention_backends import make_model, run_schedule

    model = make_model()
    expected = run_schedule(model, "torch", page_size, FP8)
    got = run_schedule(model, backend, page_size, FP8)
    bf16 = run_schedule(model, "torch", page_size)
    for step, (g, e, b) in enumerate(zip(got, expected, bf16, strict=True)):
        err = (g - e).abs().max().item()
        scale = e.abs().max().item()
        bound = 0.03 * scale + 1e-2
        gap = (b - e).abs().max().item()
        print(f"{backend} page {page_size} step {step}: err {err:.4f}, fp8-bf16 gap {gap:.4f}, "
              f"bound {bound:.4f}")  # fmt: skip
        assert gap > bound, f"step {step}: the fp8 pool is only {gap} from bf16's logits"
        assert err <= bound, f"step {step}: max err {err} (logit scale {scale})"


def test_fp8_engine_against_its_bf16_twin(random_llama_d64: Path) -> None:
    """quantization='fp8' (weights quantized on the GPU at load) with an fp8 KV pool, CUDA graphs
    on, FlashInfer where installed: prompt logprobs (the _scaled_mm path) near the bf16 engine's,
    and the graphs' greedy tokens (the GEMV path) equal the same engine's eager ones."""
    import weft

    prompts = [f"w{i} w{3 * i + 1} w{7 * i + 2} w{i * i % 500} w{i + 9}" * 8 for i in range(1, 5)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    backend = "flashinfer" if "flashinfer" in FP8_BACKENDS else "triton"

    def run(**kwargs: object) -> list[dict]:
        with weft.Engine(str(random_llama_d64), device="cuda", attention_backend=backend,
                         **kwargs) as eng:  # fmt: skip
            out = eng.generate(prompts, params, return_logprob=True, logprob_start_len=0)
        assert isinstance(out, list)
        return out

    bf16 = run()
    fp8 = run(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    eager = run(quantization="fp8", kv_cache_dtype="fp8_e4m3", disable_cuda_graph=True)
    diffs = []
    for a, b in zip(bf16, fp8, strict=True):
        pa = [lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]]
        pb = [lp for lp, _, _ in b["meta_info"]["input_token_logprobs"][1:]]
        diffs += [abs(x - y) for x, y in zip(pa, pb, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(f"fp8 vs bf16 prompt logprobs: mean |diff| {mean:.4f}, max {max(diffs):.4f}")
    assert 0 < mean < 0.1
    assert [o["output_ids"] for o in fp8] == [o["output_ids"] for o in eager]
