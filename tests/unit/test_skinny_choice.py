"""runtime/skinny.py: the projections grouped by shape, WEFT_GEMV checked, nothing chosen off CUDA."""

from __future__ import annotations

import pytest
import torch
import transformers

from weft.runtime import skinny
from weft.runtime.models import build_model


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return build_model(config, 64, torch.device("cpu"), torch.float32)


def test_projections_are_grouped_by_shape_with_the_down_projection_gated() -> None:
    groups = skinny.by_shape(tiny_llama())
    # qkv: 32 -> 4 q heads + 2 x 2 kv heads of 8; o: 32 -> 32; gate/up: 32 -> 96; down: 48 -> 32
    assert {k: len(v) for k, v in groups.items()} == {
        (64, 32, False): 3, (32, 32, False): 3, (96, 32, False): 3, (32, 48, True): 3,
    }  # fmt: skip


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_nothing_is_chosen_for_weights_off_cuda(mode: str) -> None:
    model = tiny_llama()
    picks = skinny.choose(model, [1, 2, 4, 8], dict.fromkeys([1, 2, 4, 8], "cublas"), mode)
    assert len(picks) == 4 and not any(picks.values())
    assert all(not m.gemv_sizes for group in skinny.by_shape(model).values() for m in group)


def test_weft_gemv_must_be_a_known_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_GEMV", "always")
    with pytest.raises(ValueError, match="WEFT_GEMV must be auto, on or off, got 'always'"):
        skinny.mode_from_env()
    monkeypatch.setenv("WEFT_GEMV", "off")
    assert skinny.mode_from_env() == "off"
