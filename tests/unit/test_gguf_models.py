"""Models that keep GGUF blocks (runtime/models/quant/gguf.py) on CPU: every quant type in one
tiny model against the same weights dequantized, tied embeddings, the Q4_K_M layout of dummy
weights, memory; on the real files (skipped where absent) greedy tokens equal to the
dequantize-at-load path."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from weft.kernels import gguf as kgguf
from weft.runtime.loader.gguf_tensors import BlockTensor
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.layers import Projection, silu_and_mul
from weft.runtime.models.quant.gguf import GGUFLinear, GGUFQuantConfig, q4_k_m_types
from weft.runtime.models.weights import dummy_weights

MODELS = Path.home() / ".cache" / "weft-models"
QWEN_05B = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_15B = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
ALL_TYPES = [t.ggml_id for t in kgguf.TYPES.values()]


def config(tied: bool) -> Any:
    return transformers.Qwen2Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip


def every_type(cfg: Any) -> dict[str, int]:
    """Each projection of the model a different type, round-robin over all eight (q, k and v
    of one layer differ, so the fused qkv holds three parts); the embedding Q4_K."""
    types = {"model.embed_tokens.weight": 12}
    if not cfg.tie_word_embeddings:
        types["lm_head.weight"] = 14
    names = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up",
                                                                                "down")]  # fmt: skip
    i = 0
    for layer in range(cfg.num_hidden_layers):
        for name in names:
            types[f"model.layers.{layer}.{name}.weight"] = ALL_TYPES[i % len(ALL_TYPES)]
            i += 1
    return types


def quantized_and_dense(cfg: Any, types: dict[str, int]) -> tuple[Any, Any]:
    """The model holding random blocks of `types`, and a float32 model of the same weights."""
    quant = GGUFQuantConfig(types, cfg)
    model = build_model(cfg, 64, torch.device("cpu"), torch.float32, quant=quant)
    ckpt = list(dummy_weights(model.checkpoint_shapes(), 3, torch.device("cpu"), torch.float32,
                              0.02, quant))  # fmt: skip
    model.load_weights(ckpt)
    dense = build_model(cfg, 64, torch.device("cpu"), torch.float32)
    dense.load_weights((n, t.read(-1, 0, 0) if isinstance(t, BlockTensor) else t) for n, t in ckpt)
    return model, dense


def matrices(model: Any) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 2}


@pytest.mark.parametrize("tied", [False, True])
def test_every_type_matches_the_dequantized_model(tied: bool) -> None:
    cfg = config(tied)
    model, dense = quantized_and_dense(cfg, every_type(cfg))
    # no full-precision copy of any matrix: blocks only, about 4.5-8.5 bits per weight
    assert {p.dtype for p in matrices(model).values()} == {torch.uint8}
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, GGUFLinear) and len(qkv.quant.parts) == 3
    if tied:  # the lm_head reads the embedding's blocks
        assert model.lm_head.part0 is model.embed_tokens.part0
    ids = torch.tensor([0, 5, 299, 5])
    torch.testing.assert_close(model.embed_tokens(ids), dense.embed_tokens(ids))
    x = torch.randn(5, 256)
    torch.testing.assert_close(model.compute_logits(x), dense.compute_logits(x))
    for (name, q), d in zip(
        [(n, m) for n, m in model.named_modules() if isinstance(m, Projection)],
        [m for m in dense.modules() if isinstance(m, Projection)],
        strict=True,
    ):
        xi = torch.randn(3, d.in_features)
        torch.testing.assert_close(q(xi), d(xi), rtol=1e-5, atol=1e-5, msg=name)
        if q.gated:
            gate_up = torch.randn(3, 2 * d.in_features)
            torch.testing.assert_close(q.forward_gated(gate_up, silu_and_mul),
                                       d.forward_gated(gate_up, silu_and_mul))  # fmt: skip


def test_dense_tensors_of_the_file_stay_dense_and_bad_types_are_named() -> None:
    cfg = config(False)
    types = every_type(cfg)
    types["model.layers.1.mlp.down_proj.weight"] = 1  # F16 in the file: a dense layer
    model, _ = quantized_and_dense(cfg, types)
    down = model.layers[1].mlp.down_proj
    assert down.quant is None and down.weight.dtype == torch.float32
    types["model.layers.0.mlp.up_proj.weight"] = 10  # Q2_K: not kept quantized
    with pytest.raises(ValueError, match="up_proj.weight has ggml type 10.*dequantize=True"):
        build_model(cfg, 64, torch.device("cpu"), torch.float32, quant=GGUFQuantConfig(types, cfg))


def test_a_layer_refuses_a_tensor_of_another_type() -> None:
    cfg = config(False)
    types = every_type(cfg)
    quant = GGUFQuantConfig(types, cfg)
    model = build_model(cfg, 64, torch.device("cpu"), torch.float32, quant=quant)
    ckpt = dict(dummy_weights(model.checkpoint_shapes(), 0, torch.device("cpu"), torch.float32,
                              0.02, GGUFQuantConfig({**types, "lm_head.weight": 12}, cfg)))  # fmt: skip
    with pytest.raises(ValueError, match="lm_head: shard '' is Q4_K in the file"):
        model.load_weights(ckpt.items())
    ckpt["lm_head.weight"] = torch.zeros(300, 256)
    with pytest.raises(ValueError, match="lm_head: a GGUF layer loads tensors of its GGUF file"):
        model.load_weights(ckpt.items())


def test_dummy_q4_k_m_takes_about_a_quarter_of_bf16() -> None:
    cfg = config(False)
    quant = GGUFQuantConfig(q4_k_m_types(cfg), cfg)
    model = build_model(cfg, 64, torch.device("cpu"), torch.bfloat16, quant=quant)
    init_dummy_weights(model, 0, quant=quant)
    dense = build_model(cfg, 64, torch.device("cpu"), torch.bfloat16)
    ratio = sum(p.nbytes for p in matrices(model).values()) / sum(
        p.nbytes for p in matrices(dense).values()
    )
    assert 0.28 < ratio < 0.34, ratio  # 4.5 bits (Q4_K) with some 6.56 (Q6_K) over 16
    assert not model.embed_tokens(torch.tensor([1, 2])).isnan().any()


@pytest.mark.parametrize("path", [QWEN_05B, QWEN_15B], ids=["0.5b", "1.5b"])
def test_q4_k_m_layout_counts_match_the_real_file(path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"{path} is absent (shared/tools/fetch-models.sh qwen-coder-0.5b ...)")
    from weft.runtime.loader import convert_gguf, read_hf_config
    from weft.runtime.loader.gguf_header import read_gguf_header
    from weft.runtime.loader.gguf_tensors import gguf_tensor_types

    real = gguf_tensor_types(read_gguf_header(path))
    quantized = {n: t for n, t in real.items() if n.endswith("proj.weight") or "embed" in n
                 or n.startswith("lm_head")}  # fmt: skip
    hf_config = _config_of(path, convert_gguf, read_hf_config)
    assert Counter(q4_k_m_types(hf_config).values()) == Counter(quantized.values())


def _config_of(path: Path, convert: Any, read: Any) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        return read(convert(path, Path(cache), weights=False))


PROMPTS = [
    "def quicksort(arr):",
    "The three primary colours are",
    "SELECT name FROM users WHERE",
]


def _greedy(model: str | None, cache: Path, **kwargs: Any) -> list[list[int]]:
    from weft import Engine

    params = {"max_new_tokens": 8, "temperature": 0.0}
    with Engine(model=model, cache_dir=str(cache), **kwargs) as engine:
        outs = engine.generate(PROMPTS, params)
    assert isinstance(outs, list)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("path", [None, QWEN_05B], ids=["smollm2-packaged", "qwen-0.5b"])
def test_greedy_tokens_equal_the_dequantize_at_load_path(path: Path | None,
                                                         weft_cache: Path) -> None:  # fmt: skip
    """The packaged SmolLM2 (llama: q/k rows unpermuted from the blocks; Q4_1, Q8_0) and the
    Qwen2.5-Coder 0.5B Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K, biases), in float32 on CPU."""
    if path is not None and not path.is_file():
        pytest.skip(f"{path} is absent (shared/tools/fetch-models.sh qwen-coder-0.5b)")
    model = None if path is None else str(path)
    kept = _greedy(model, weft_cache, quantization="gguf")
    converted = _greedy(model, weft_cache, dequantize=path is not None)
    assert kept == converted
    assert all(len(ids) == 8 for ids in kept)


def test_step_benchmark_runs_the_kept_quantized_variant(tmp_path: Path) -> None:
    """benchmarks/step.py decode with a `quantization=gguf` variant (the GPU command of the
    issue's GGUF row), as a CPU smoke run: it reports the weights' memory beside the dense run."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_utils
    import step

    bench_utils.write_config(tmp_path, hidden_size=256, intermediate_size=512, head_dim=64,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)  # fmt: skip
    out = tmp_path / "step.json"
    argv = ["decode", "--config", str(tmp_path), "--backends", "torch", "--batches", "1", "2",
            "--context", "16", "--reps", "1", "--variant", "dense:",
            "--variant", "gguf:quantization=gguf", "--output-file", str(out)]  # fmt: skip
    assert step.main(argv) == 0
    rows = {(r["backend"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    dense, kept = rows[("torch dense", 1)]["weights_MiB"], rows[("torch gguf", 1)]["weights_MiB"]
    assert 0.05 < kept / dense < 0.2  # float32 on CPU: 4.5-6.6 bits against 32
