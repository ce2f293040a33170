"""Tensor parallelism of the model: head / column / vocab sharding, and TP=2 (gloo, two processes)
giving the logits of TP=1 on tiny random models (more and fewer kv heads than ranks, uneven splits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from weft.runtime.models import TPInfo, build_model, init_dummy_weights
from weft.runtime.models.parallel import check_tp, even_split, head_shard

sys.path.insert(0, str(Path(__file__).parent))
from tp_worker import prefill_logits  # noqa: E402

WORKER = Path(__file__).with_name("tp_worker.py")
BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
}
CASES: dict[str, dict[str, Any]] = {
    "llama_kv2": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
                  "vocab_size": 101, "architectures": ["LlamaForCausalLM"]},
    "llama_kv1_tied": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1,
                       "vocab_size": 96, "tie_word_embeddings": True,
                       "architectures": ["LlamaForCausalLM"]},
    "qwen2_uneven": {"model_type": "qwen2", "num_attention_heads": 6, "num_key_value_heads": 3,
                     "head_dim": 16, "vocab_size": 97, "architectures": ["Qwen2ForCausalLM"]},
    "qwen3_qknorm": {"model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "vocab_size": 100, "architectures": ["Qwen3ForCausalLM"]},
}  # fmt: skip


def test_even_split_covers_everything_once() -> None:
    for n in range(0, 13):
        for parts in range(1, 5):
            spans = [even_split(n, parts, i) for i in range(parts)]
            assert sum(c for _, c in spans) == n
            assert all(
                s == prev_s + prev_c
                for (prev_s, prev_c), (s, _) in zip(spans, spans[1:], strict=False)
            )


@pytest.mark.parametrize(("heads", "kv", "tp"), [(9, 3, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4)])
def test_head_shards_cover_every_q_head_with_its_own_kv_head(heads: int, kv: int, tp: int) -> None:
    seen: list[int] = []
    for rank in range(tp):
        h = head_shard(heads, kv, tp, rank)
        q_heads = list(range(h.q_start, h.q_start + h.q_count))
        kv_heads = range(h.kv_start, h.kv_start + h.kv_count)
        seen += q_heads
        assert all(q // (heads // kv) in kv_heads for q in q_heads)  # GQA groups stay whole
    assert sorted(seen) == list(range(heads))


def test_impossible_layouts_are_refused_with_the_reason() -> None:
    config = transformers.LlamaConfig(num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="multiple of the model's 3 kv heads"):
        check_tp(config, 4)
    config = transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=1, hidden_size=32)
    with pytest.raises(ValueError, match="exceeds the model's 2 attention heads"):
        check_tp(config, 4)


def test_shards_hold_only_their_part() -> None:
    config = transformers.AutoConfig.for_model(**{**BASE, **CASES["qwen2_uneven"]})
    shapes = []
    for rank in range(2):
        model = build_model(config, 64, torch.device("cpu"), torch.float32, TPInfo(rank, 2))
        attn = model.layers[0].self_attn
        shapes.append((attn.num_heads, attn.num_kv_heads, model.layers[0].mlp.inter))
        assert model.embed_tokens.weight.shape == (49, 64)  # 97 rows padded to 2 x 49
    assert shapes == [(4, 2, 48), (2, 1, 48)]


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tp2_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Every case run once on two gloo ranks (two processes)."""
    tmp = tmp_path_factory.mktemp("tp2")
    specs = {
        case: {"config": {**BASE, **cfg}, "ids": _ids(cfg["vocab_size"]).tolist()}
        for case, cfg in CASES.items()
    }
    out = tmp / "logits.pt"
    init = f"file://{tmp / 'rendezvous'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(WORKER), "", "2", init, json.dumps(specs), str(out)]
    procs = [subprocess.Popen([*argv[:2], str(rank), *argv[3:]], env=env) for rank in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    result: dict[str, torch.Tensor] = torch.load(out)
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_logits_equal_tp1(case: str, tp2_logits: dict[str, torch.Tensor]) -> None:
    cfg = {**BASE, **CASES[case]}
    config = transformers.AutoConfig.for_model(**cfg)
    model = build_model(config, 64, torch.device("cpu"), torch.float32)
    init_dummy_weights(model, seed=5, std=0.2)  # TP=1 gets the same weights, unsharded
    expected = prefill_logits(model, config, _ids(cfg["vocab_size"]))
    got = tp2_logits[case]
    assert got.shape == (12, cfg["vocab_size"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_ranks_that_diverge_stop_with_a_message(tp2_logits: dict[str, torch.Tensor]) -> None:
    """TPGroup.check_agree (run before every batch) raised on rank 0 when the ranks disagreed."""
    assert int(tp2_logits["_diverged_raises"]) == 1
