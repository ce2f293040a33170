"""The L2 weight prefetch plan: parsing, which weight each layer point asks for, and that a model
with a prefetcher attached computes what it computed without one (CPU; the kernel is in tests/gpu)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.unit.test_models import PagedRequest
from weft.kernels.prefetch import l2_prefetch, supports_l2_prefetch
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.prefetch import (
    DEFAULT_MODE,
    DEFAULT_PLAN,
    MIB,
    PrefetchPlan,
    plan_from_env,
)


def test_plan_parses_and_names_bad_entries() -> None:
    plan = PrefetchPlan.parse(" qkv:o_proj , attn:gate_up:16,down:next_qkv:0.5", max_batch=8)
    assert [(e.point, e.weight, e.mib) for e in plan.entries] == [
        ("qkv", "o_proj", None), ("attn", "gate_up", 16.0), ("down", "next_qkv", 0.5),
    ]  # fmt: skip
    assert plan.max_batch == 8
    for text, message in [
        ("", "at least one"),
        ("qkv", "point:weight"),
        ("qkv:o_proj:1:2", "point:weight"),
        ("rotary:o_proj", "point 'rotary'"),
        ("qkv:lm_head", "weight 'lm_head'"),
        ("qkv:o_proj:big", "not a number"),
        ("qkv:o_proj:0", "> 0 MiB"),
    ]:
        with pytest.raises(ValueError, match=message):
            PrefetchPlan.parse(text)
    with pytest.raises(ValueError, match="max batch"):
        PrefetchPlan.parse("qkv:o_proj", max_batch=0)


def test_plan_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEFT_L2_PREFETCH", raising=False)
    assert plan_from_env() == (None if DEFAULT_MODE == "off" else PrefetchPlan.parse(DEFAULT_PLAN))
    monkeypatch.setenv("WEFT_L2_PREFETCH", "on")
    assert plan_from_env() == PrefetchPlan.parse(DEFAULT_PLAN)
    monkeypatch.setenv("WEFT_L2_PREFETCH", "off")
    assert plan_from_env() is None
    monkeypatch.setenv("WEFT_L2_PREFETCH", "qkv:o_proj")
    monkeypatch.setenv("WEFT_L2_PREFETCH_MAX_BS", "4")
    assert plan_from_env() == PrefetchPlan.parse("qkv:o_proj", max_batch=4)
    monkeypatch.setenv("WEFT_L2_PREFETCH_MAX_BS", "four")
    with pytest.raises(ValueError, match="WEFT_L2_PREFETCH_MAX_BS"):
        plan_from_env()


def tiny_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
    )  # fmt: skip
    model = build_model(config, 128, torch.device("cpu"), torch.float32)
    init_dummy_weights(model, seed=1)
    return model


def test_each_point_asks_for_its_weights_only_while_active() -> None:
    model = tiny_model()
    calls: list[tuple[int, str, int]] = []
    names = {}
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        for name, w in (("qkv", a.qkv_proj.weight), ("o_proj", a.o_proj.weight),
                        ("gate_up", m.gate_up_proj.weight), ("down", m.down_proj.weight)):  # fmt: skip
            names[w.data_ptr()] = (i, name)

    def record(weight: torch.Tensor, nbytes: int) -> None:
        calls.append((*names[weight.data_ptr()], nbytes))

    plan = PrefetchPlan.parse("qkv:o_proj,attn:gate_up:0.01,down:next_qkv")
    prefetcher = model.enable_prefetch(plan)
    prefetcher._prefetch = record  # record instead of launching the GPU kernel
    req = PagedRequest(model, model.config, 1, 8)
    ids = torch.randint(0, 97, (8,))
    req.run(model, ids, 0, 4)
    assert calls == [], "an inactive prefetcher issues nothing"
    with prefetcher.active():
        req.run(model, ids, 4, 5)
    o_bytes = 64 * 64 * 4
    head = int(0.01 * MIB)  # 10485 B: under gate_up's 2 x 96 x 64 x 4 = 49152
    qkv_bytes = (64 + 2 * 32) * 64 * 4
    assert calls == [
        (0, "o_proj", o_bytes), (0, "gate_up", head), (1, "qkv", qkv_bytes),
        (1, "o_proj", o_bytes), (1, "gate_up", head), (2, "qkv", qkv_bytes),
        (2, "o_proj", o_bytes), (2, "gate_up", head),  # the last layer has no next_qkv
    ]  # fmt: skip
    calls.clear()
    with prefetcher.active(False):
        req.run(model, ids, 5, 6)
    assert calls == []


def test_a_prefetching_model_computes_the_same_logits() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    ids = torch.randint(0, 97, (12,))
    plain = PagedRequest(model, model.config, 4, 12)
    expected = torch.cat([plain.run(model, ids, 0, 9), plain.run(model, ids, 9, 10)])
    prefetcher = model.enable_prefetch(PrefetchPlan.parse("qkv:o_proj,gate_up:down:1"))
    prefetcher._prefetch = lambda weight, nbytes: None
    again = PagedRequest(model, model.config, 4, 12)
    with prefetcher.active():
        got = torch.cat([again.run(model, ids, 0, 9), again.run(model, ids, 9, 10)])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_l2_prefetch_refuses_what_it_cannot_fetch() -> None:
    assert not supports_l2_prefetch(torch.device("cpu"))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        l2_prefetch(torch.zeros(64))
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(8, 8).t())
