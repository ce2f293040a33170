"""FP8 checkpoints as published, written here with safetensors at tiny sizes (compressed-tensors
per-channel / per-tensor with static input scales, HF fp8 per-tensor and block-wise) and a bf16 one
quantized at load: each loaded projection equals the dequantized reference, by tensor-parallel
rank too; what FP8 cannot load is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from weft.kernels.fp8 import FP8, fp8_linear_ref, quantize_per_channel
from weft.runtime.loader import iterate_weight_slices, read_hf_config
from weft.runtime.loader.fp8_checkpoint import fp8_scheme, refuse_quantized_checkpoint
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.layers import Projection
from weft.runtime.models.parallel import TPInfo
from weft.runtime.models.quant import QuantContext, make_quant_config
from weft.runtime.models.weights import dummy_weights

CONFIG = transformers.Qwen2Config(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"],
)  # fmt: skip
BLOCK = (32, 32)

CT_CHANNEL = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                    "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}},
}  # fmt: skip
CT_TENSOR_STATIC = json.loads(json.dumps(CT_CHANNEL))
CT_TENSOR_STATIC["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
CT_TENSOR_STATIC["config_groups"]["group_0"]["input_activations"] = {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}  # fmt: skip
HF_TENSOR_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}
HF_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
FORMATS = {
    "ct-channel": CT_CHANNEL,
    "ct-tensor-static": CT_TENSOR_STATIC,
    "hf-tensor-static": HF_TENSOR_STATIC,
    "hf-block": HF_BLOCK,
}


def _float_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    ref = build_model(CONFIG, 64, torch.device("cpu"), torch.float32)
    tensors = dict(dummy_weights(ref.checkpoint_shapes(), seed, torch.device("cpu"),
                                 torch.float32, std=0.1))  # fmt: skip
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        if name.endswith("proj.weight"):  # rows of very different sizes: scales must follow
            t *= torch.logspace(-1, 1, t.shape[0])[:, None]
        if name.endswith(".bias"):
            t.normal_(0, 0.1)
    return {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}


INPUT_SCALES = {"q_proj": 0.03, "k_proj": 0.05, "v_proj": 0.02}  # static: calibrated per tensor


def _quantize(
    fmt: str, w: torch.Tensor, input_scale: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors by suffix, the dequantized weight) of one projection in `fmt`."""
    if fmt == "ct-channel":
        q, s = quantize_per_channel(w)
        return {"weight": q, "weight_scale": s[:, None]}, q.float() * s[:, None]
    if fmt == "hf-block":
        bn, bk = BLOCK
        n, k = w.shape
        blocks = w.reshape(n // bn, bn, k // bk, bk).abs().amax(dim=(1, 3)) / 448.0
        full = blocks.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        q = (w / full).to(FP8)
        return {"weight": q, "weight_scale_inv": blocks}, q.float() * full
    s = w.abs().max() / 448.0
    q = (w / s).to(FP8)
    scale = s.reshape(1) if fmt.startswith("ct") else s.reshape(())
    parts = {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(input_scale)}
    return parts, q.float() * s


def write_checkpoint(folder: Path, fmt: str | None) -> dict[str, torch.Tensor]:
    """An HF folder of the format (None: plain float32); returns the dequantized checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors, deq = {}, {}
    for name, t in _float_checkpoint().items():
        if fmt is not None and name.endswith("proj.weight"):
            kind = name.split(".")[-2]
            parts, deq[name] = _quantize(fmt, t, INPUT_SCALES.get(kind, 0.04))
            for suffix, part in parts.items():
                tensors[name.removesuffix("weight") + suffix] = part.contiguous()
        else:
            tensors[name] = deq[name] = t
    save_file(tensors, str(folder / "model.safetensors"))
    config: dict[str, Any] = CONFIG.to_dict()
    if fmt is not None:
        config["quantization_config"] = FORMATS[fmt]
    (folder / "config.json").write_text(json.dumps(config))
    return deq


def load(folder: Path, tp: TPInfo | None = None, dummy: bool = False) -> Any:
    hf = read_hf_config(folder)
    quant = make_quant_config("fp8", QuantContext(hf, folder, torch.float32, dummy))
    model = build_model(hf, 64, torch.device("cpu"), torch.float32, tp, quant)
    if dummy:
        init_dummy_weights(model, 0, quant=quant)
    else:
        model.load_weights(iterate_weight_slices(folder))
    return model


def projections(model: Any) -> dict[str, Projection]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Projection)}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_loads_as_its_dequantized_reference(fmt: str, tmp_path: Path) -> None:
    deq = write_checkpoint(tmp_path, fmt)
    model = load(tmp_path)
    ref = build_model(CONFIG, 64, torch.device("cpu"), torch.float32)
    ref.load_weights(deq.items())
    for name, layer in projections(model).items():
        ref_layer = projections(ref)[name]
        assert layer.weight.dtype == FP8 and layer.quant is not None
        got = layer.weight.float() * layer.weight_scale[:, None]
        if fmt == "hf-block":  # folded into per-row scales: each weight re-rounded once
            err = (got - ref_layer.weight).abs() <= ref_layer.weight.abs() / 16 + 1e-6
            assert err.all(), name
        else:
            torch.testing.assert_close(got, ref_layer.weight, rtol=1e-6, atol=0, msg=name)
        x = torch.randn(5, layer.in_features)
        static = getattr(layer, "input_scale", None)
        want = fp8_linear_ref(x, layer.weight, layer.weight_scale, layer.bias, static)
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4, msg=name)
        # W8A8 stays near the full-precision product of the dequantized weight
        exact = ref_layer(x)
        assert ((layer(x) - exact).norm() / exact.norm()).item() < 0.1, name
    if fmt.endswith("static"):  # one input scale per fused layer: the largest of its shards
        layers = projections(model)
        assert layers["layers.0.self_attn.qkv_proj"].input_scale.item() == pytest.approx(0.05)
        assert layers["layers.1.mlp.down_proj"].input_scale.item() == pytest.approx(0.04)


@pytest.mark.parametrize("fmt", ["ct-channel", "hf-tensor-static", "hf-block", None])
def test_each_tensor_parallel_rank_loads_its_slice(fmt: str | None, tmp_path: Path) -> None:
    """Row-split layers (o_proj, down_proj) keep every row's scale; column-split ones take their
    rows' scales; a bf16 checkpoint is quantized, and block scales folded, per rank slice (k/v
    rows of a rank start inside a block)."""
    write_checkpoint(tmp_path, fmt)
    whole = projections(load(tmp_path))
    for rank in (0, 1):
        part = projections(load(tmp_path, TPInfo(rank, 2)))
        for name, layer in part.items():
            full = whole[name].weight.float() * whole[name].weight_scale[:, None]
            got = layer.weight.float() * layer.weight_scale[:, None]
            if "o_proj" in name or "down_proj" in name:  # split along K
                k = got.shape[1]
                want = full[:, rank * k : (rank + 1) * k]
            elif "gate_up" in name:
                inter = got.shape[0] // 2
                halves = full.chunk(2)
                want = torch.cat([h[rank * inter : (rank + 1) * inter] for h in halves])
            else:  # q rows, then k rows, then v rows of this rank's heads
                q, kv = 32, 16
                fq, fk, fv = full.split([64, 32, 32])
                want = torch.cat((fq[rank * q : (rank + 1) * q], fk[rank * kv : (rank + 1) * kv],
                                  fv[rank * kv : (rank + 1) * kv]))  # fmt: skip
            if fmt in (None, "hf-block"):  # rounded per rank slice: within a step of the whole's
                assert ((got - want).abs() <= want.abs() / 8 + 1e-4).all(), name
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=name)


def test_bf16_checkpoint_is_quantized_per_channel_at_load(tmp_path: Path) -> None:
    original = write_checkpoint(tmp_path, None)
    model = load(tmp_path)
    assert not fp8_scheme(read_hf_config(tmp_path)).prequantized
    ref = build_model(CONFIG, 64, torch.device("cpu"), torch.float32)
    ref.load_weights(original.items())
    for name, layer in projections(model).items():
        w = projections(ref)[name].weight
        q, s = quantize_per_channel(w)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), name
        torch.testing.assert_close(layer.weight_scale, s, msg=name)
    assert model.embed_tokens.weight.dtype == torch.float32  # embedding and head stay
    assert model.lm_head.weight.dtype == torch.float32


def test_dummy_weights_quantize_at_load(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "ct-channel")  # a prequantized config: dummy draws floats anyway
    model = load(tmp_path, dummy=True)
    for layer in projections(model).values():
        assert layer.weight.dtype == FP8 and (layer.weight_scale > 0).all()
        assert layer.weight.float().abs().amax(1).eq(448.0).all()


def _ct(**changes: Any) -> dict[str, Any]:
    qc = json.loads(json.dumps(CT_CHANNEL))
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        where, field = key.split("__")
        if where == "top":
            qc[field] = value
        elif value is None:
            group[where] = None
        else:
            group[where][field] = value
    return qc


@pytest.mark.parametrize(
    ("qc", "error"),
    [
        ({"quant_method": "awq"}, "quant_method='awq'"),
        (_ct(top__format="pack-quantized"), "format='pack-quantized' is not FP8"),
        (_ct(weights__num_bits=4), "not FP8"),
        (_ct(weights__strategy="group"), "strategy 'group' is not supported"),
        (_ct(input_activations__x=None), "weight-only"),
        (_ct(input_activations__strategy="group"), "by 'group'"),
        (_ct(top__kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "is not \\[n, k\\]"),
    ],
)
def test_what_fp8_cannot_load_is_refused(qc: dict[str, Any], error: str) -> None:
    config = transformers.Qwen2Config(**{**CONFIG.to_dict(), "quantization_config": qc})
    with pytest.raises(ValueError, match=error):
        fp8_scheme(config)


def test_a_quantized_checkpoint_without_the_option_names_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "ct-channel")
    with pytest.raises(ValueError, match="--quantization fp8"):
        refuse_quantized_checkpoint(read_hf_config(tmp_path))
    write_checkpoint(tmp_path / "plain", None)
    refuse_quantized_checkpoint(read_hf_config(tmp_path / "plain"))  # nothing to say


def test_ignored_layers_stay_in_full_precision(tmp_path: Path) -> None:
    qc = _ct(top__ignore=["lm_head", "re:.*layers\\.1\\.mlp\\.(gate|up|down)_proj"])
    config = transformers.Qwen2Config(**{**CONFIG.to_dict(), "quantization_config": qc})
    quant = make_quant_config("fp8", QuantContext(config, None, torch.float32))
    model = build_model(config, 64, torch.device("cpu"), torch.float32, quant=quant)
    kept = {n for n, m in projections(model).items() if m.quant is None}
    assert kept == {"layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"}
    half = _ct(top__ignore=["model.layers.0.self_attn.q_proj"])
    config = transformers.Qwen2Config(**{**CONFIG.to_dict(), "quantization_config": half})
    quant = make_quant_config("fp8", QuantContext(config, None, torch.float32))
    with pytest.raises(ValueError, match="ignores only some of"):
        build_model(config, 64, torch.device("cpu"), torch.float32, quant=quant)
