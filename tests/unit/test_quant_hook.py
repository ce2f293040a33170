"""The quantization hook (runtime/models/quant/base.py) with a test-only int8 per-row method:
storage made on meta (no full-precision copy), checkpoint tensors routed per shard, finish,
apply, graph tuning skipping quantized layers; the engine options."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from weft.cli import main
from weft.runtime.config import EngineConfig
from weft.runtime.executor.graph_tuning import by_shape
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.layers import Projection, silu_and_mul
from weft.runtime.models.quant import QuantConfig, QuantMethod, quantized_layers, storage_parameter
from weft.runtime.models.quant.base import weight_shape
from weft.runtime.models.weights import Placement, Weight, map_name

CONFIG = transformers.Qwen2Config(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip


class Int8Rows(QuantMethod):
    """int8 weight [N, K] with a float32 scale per row, loaded from `weight` + `weight_scale`."""

    def __init__(self) -> None:
        self.finished = False

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        del layer.weight
        layer.weight = storage_parameter((out_features, in_features), torch.int8)
        layer.weight_scale = storage_parameter((out_features,), torch.float32)

    def checkpoint_suffixes(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def load(self, layer: nn.Module, suffix: str, shard: str, src: Weight,
             place: Placement) -> None:  # fmt: skip
        assert isinstance(src, torch.Tensor)
        dst = getattr(layer, suffix).narrow(0, place.dst_start, src.shape[0])
        dst.copy_(src)

    def finish(self, layer: nn.Module) -> None:
        self.finished = True

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        w = layer.weight.float() * layer.weight_scale[:, None]
        return F.linear(x, w.to(x.dtype), bias)

    def main_tensor(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight


class Int8Config(QuantConfig):
    name = "int8-test"

    def __init__(self) -> None:
        self.methods: dict[str, Int8Rows] = {}

    def method(self, prefix: str, layer: nn.Module) -> QuantMethod | None:
        if not isinstance(layer, Projection):
            return None
        self.methods[prefix] = Int8Rows()
        return self.methods[prefix]


def int8_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random HF-named checkpoint: projections as int8 + per-row scales, the rest float."""
    ref = build_model(CONFIG, 64, torch.device("cpu"), torch.float32)
    init_dummy_weights(ref, seed, std=0.1)
    out: dict[str, torch.Tensor] = {}
    for name, shape in ref.checkpoint_shapes():
        target = map_name(name)
        assert target is not None
        is_proj = name.endswith("proj.weight")
        gen = torch.Generator().manual_seed(hash(name) % 1000)
        if is_proj:
            out[name] = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            out[name.replace(".weight", ".weight_scale")] = torch.rand(shape[0], generator=gen)
        else:
            out[name] = torch.randn(shape, generator=gen)
    return out


def dequantized(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in ckpt.items():
        if name.endswith("weight_scale"):
            continue
        scale = ckpt.get(f"{name}_scale") if name.endswith("proj.weight") else None
        out[name] = t.float() * scale[:, None] if scale is not None else t
    return out


def test_storage_is_made_on_meta_without_a_full_precision_copy() -> None:
    quant = Int8Config()
    model = build_model(CONFIG, 64, torch.device("cpu"), torch.float32, quant=quant)
    layers = {prefix: layer for prefix, layer, _ in quantized_layers(model)}
    assert len(layers) == 4 * CONFIG.num_hidden_layers
    qkv = layers["layers.0.self_attn.qkv_proj"]
    assert qkv.weight.dtype == torch.int8 and qkv.weight.shape == (32 + 2 * 16, 32)
    assert qkv.bias.dtype == torch.float32  # a quantized layer's bias stays a plain parameter
    floats = [n for n, p in model.named_parameters()
              if p.dtype == torch.float32 and n.endswith("proj.weight")]  # fmt: skip
    assert floats == []
    assert all(m.quant is not None for m in layers.values() if isinstance(m, Projection))
    assert by_shape(model) == {}  # the bf16 GEMV / graph tuning never sees a quantized layer


def test_checkpoint_tensors_route_to_the_method_per_shard() -> None:
    ckpt = int8_checkpoint()
    quant = Int8Config()
    model = build_model(CONFIG, 64, torch.device("cpu"), torch.float32, quant=quant)
    model.load_weights(ckpt.items())
    assert all(m.finished for m in quant.methods.values())
    ref = build_model(CONFIG, 64, torch.device("cpu"), torch.float32)
    ref.load_weights(dequantized(ckpt).items())
    x = torch.randn(3, 32)
    for (name, layer), (_, ref_layer) in zip(
        [(n, m) for n, m in model.named_modules() if isinstance(m, Projection)],
        [(n, m) for n, m in ref.named_modules() if isinstance(m, Projection)],
        strict=True,
    ):
        width = weight_shape(layer)[1]
        xi = torch.randn(3, width) if width != 32 else x
        # float32 summed in another order (the reference runs its 3 rows as W @ x^T), outputs ~1e3
        torch.testing.assert_close(layer(xi), ref_layer(xi), rtol=1e-5, atol=1e-3, msg=name)
        if layer.gated:  # the down projection, as the MLP calls it
            gate_up = torch.randn(3, 2 * width)
            torch.testing.assert_close(layer.forward_gated(gate_up, silu_and_mul),
                                       ref_layer.forward_gated(gate_up, silu_and_mul),
                                       rtol=1e-5, atol=1e-3)  # fmt: skip


def test_missing_and_unknown_quantized_tensors_are_named() -> None:
    ckpt = int8_checkpoint()
    model = build_model(CONFIG, 64, torch.device("cpu"), torch.float32, quant=Int8Config())
    partial = {k: v for k, v in ckpt.items() if k != "model.layers.1.self_attn.k_proj.weight_scale"}
    with pytest.raises(ValueError, match="missing 1 tensor.*qkv_proj.weight_scale:k"):
        model.load_weights(partial.items())
    extra = {**ckpt, "model.layers.0.mlp.down_proj.zero_point": torch.zeros(32)}
    with pytest.raises(ValueError, match="zero_point.*no place.*weight\\|weight_scale"):
        model.load_weights(extra.items())


class _DummyBlocks(Int8Config):
    def dummy_weight(self, name: str, shape: tuple[int, ...], seed: int,
                     device: torch.device) -> Weight | None:  # fmt: skip
        if name.endswith("proj.weight"):
            return torch.ones(shape, dtype=torch.int8, device=device)
        if name.endswith("proj.weight_scale"):
            return torch.full(shape, 0.5, device=device)
        return None


def test_dummy_weights_ask_the_quant_config() -> None:
    quant = _DummyBlocks()
    model = build_model(CONFIG, 64, torch.device("cpu"), torch.float32, quant=quant)
    shapes = dict(model.checkpoint_shapes())
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 32)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    with pytest.raises(ValueError, match="missing.*weight_scale"):
        init_dummy_weights(model, 0, quant=quant)  # the dummy checkpoint has no scales


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"quantization": "int4"}, "quantization must be"),
        ({"model": "/some/folder", "dequantize": True}, "not a .gguf file"),
        ({"model": "/m.gguf", "quantization": "gguf", "dequantize": True}, "one of the two"),
        ({"model": "/some/folder", "quantization": "gguf"}, "must be a .gguf file"),
        ({"model": "/m.gguf", "quantization": "fp8"}, "needs dequantize=True"),
    ],
)
def test_engine_config_refuses_bad_combinations(kwargs: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineConfig(**kwargs)


def test_a_gguf_path_implies_gguf_unless_dequantize() -> None:
    assert EngineConfig(model="/x/m.GGUF").resolved_quantization == "gguf"
    assert EngineConfig(model="/x/m.gguf", dequantize=True).resolved_quantization is None
    assert EngineConfig().resolved_quantization is None  # the packaged model: converted
    assert EngineConfig(quantization="gguf").resolved_quantization == "gguf"
    assert EngineConfig(model="/f", quantization="fp8").resolved_quantization == "fp8"
    dummy = EngineConfig(model="/f", load_format="dummy", quantization="gguf")
    assert dummy.resolved_quantization == "gguf"


def test_cli_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--quantization", "int4"])
    assert "choose from 'gguf', 'fp8'" in capsys.readouterr().err
