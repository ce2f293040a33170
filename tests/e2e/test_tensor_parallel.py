"""Tensor parallelism end to end on CPU (gloo, one scheduler process per rank): TP=2 gives TP=1's
greedy tokens on the packaged model and on random models with more / fewer kv heads than ranks;
a rank's death stops the engine with a clear error."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import weft
from weft.runtime.server.tokenizer_manager import RuntimeDown

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village,",
]
GREEDY = {"temperature": 0, "max_new_tokens": 16}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def run_workload(engine: Any) -> list[Any]:
    """Plain greedy prompts (one shares a prefix with an earlier one), a constrained request,
    seeded sampling, and the state the schedulers report afterwards."""
    outs = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS[0] + " Paris, and", GREEDY)
    constrained = engine.generate(
        "Describe a person as JSON:",
        {**GREEDY, "max_new_tokens": 40, "json_schema": json.dumps(SCHEMA)},
    )
    sampled = engine.generate(
        PROMPTS[1], {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 12}
    )
    engine.flush_cache()
    state = engine.get_state()
    assert state["free_tokens"] == state["max_total_tokens"]  # nothing leaked on any rank
    return [
        [o["output_ids"] for o in outs],
        again["output_ids"],
        again["meta_info"]["cached_tokens"] > 0,
        constrained["text"],
        sampled["output_ids"],
    ]


def test_tp2_equals_tp1_on_the_packaged_model() -> None:
    results = {}
    for tp in (1, 2):
        with weft.Engine(tp_size=tp, cpu_threads=1) as eng:
            assert eng.server_info["tp_size"] == tp
            results[tp] = run_workload(eng)
    assert results[2] == results[1]
    value = json.loads(results[2][3])
    assert set(value) == {"name", "age"}


def random_model(folder: Path, tokenizer_dir: Path, kv_heads: int) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(kv_heads)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_tp2_equals_tp1_on_random_models(
    kv_heads: int, tmp_path: Path, default_model_dir: Path
) -> None:
    folder = random_model(tmp_path / "model", default_model_dir, kv_heads)
    ids = [[(17 * i + 5 * j) % 49000 + 3 for j in range(9 + i)] for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = {}
    # with 4 kv heads, TP=2 also runs with overlap scheduling (the CUDA default) forced on, in
    # prefills of at most 16 tokens (each launched behind the one before, a chunk going on);
    # with 1, in small prefill chunks with the running requests mixed into them
    overlap = "on" if kv_heads == 4 else "auto"
    mixed = {"enable_mixed_chunk": True, "max_prefill_tokens": 12, "chunked_prefill_size": 8}
    for tp in (1, 2):
        extra: dict[str, Any] = {}
        if tp == 2:
            extra = mixed if kv_heads == 1 else {"max_prefill_tokens": 16}
        with weft.Engine(
            str(folder),
            tp_size=tp,
            cpu_threads=1,
            overlap_schedule=overlap if tp == 2 else "off",
            **extra,
        ) as eng:
            results[tp] = [
                o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=params)
            ]
            if extra.get("enable_mixed_chunk"):
                assert eng.get_state()["mixed_steps"] > 0
    assert results[2] == results[1]


def test_a_dead_rank_stops_the_engine(tmp_path: Path, default_model_dir: Path) -> None:
    folder = random_model(tmp_path / "model", default_model_dir, 2)
    eng = weft.Engine(str(folder), tp_size=2, cpu_threads=1)
    try:
        procs = list(eng._procs.values())
        assert len(procs) == 3  # two scheduler ranks and the detokenizer
        eng._procs["scheduler rank 1"].kill()
        with pytest.raises(RuntimeDown, match="scheduler rank 1 process exited"):
            for _ in range(100):
                eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
    finally:
        eng.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_impossible_tp_size_is_refused_before_anything_starts(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="multiple of the model's 3 kv heads"):
        weft.Engine(tp_size=4)  # SmolLM2-135M has 9 heads over 3 kv heads
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        weft.Engine(tp_size=0)
