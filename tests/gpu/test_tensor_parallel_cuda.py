"""Tensor parallelism on GPUs (NCCL, one scheduler process per GPU): TP=2 gives TP=1's greedy tokens
on a random-weight model, eagerly and with CUDA graphs (all-reduce inside the graph). Needs 2 GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import save_word_tokenizer

import weft

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


PROMPTS = ["w5 w6 w7", "w100 w200 w300 w400 w500", "w9", "w1000 w2000 w3000 w4000"]


def greedy(folder: Path, **kwargs: Any) -> list[list[int]]:
    with weft.Engine(str(folder), dtype="float32", **kwargs) as eng:
        outs = eng.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("graphs", [False, True])
def test_tp2_equals_tp1(random_llama: Path, graphs: bool) -> None:
    kw: dict[str, Any] = {"attention_backend": "triton", "disable_cuda_graph": not graphs}
    if graphs:
        kw["cuda_graph_max_bs"] = 8
    assert greedy(random_llama, tp_size=2, **kw) == greedy(random_llama, tp_size=1, **kw)


def test_tp2_bf16_dummy_8b_shape_serves(tmp_path: Path) -> None:
    """The Llama-3.1-8B shape with dummy weights sharded over two GPUs, CUDA graphs on."""
    import json
    import shutil

    repo = Path(__file__).resolve().parents[2]
    folder = tmp_path / "llama-3.1-8b"
    folder.mkdir()
    shutil.copy(repo / "benchmarks/configs/llama-3.1-8b/config.json", folder / "config.json")
    save_word_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    with weft.Engine(
        str(folder), load_format="dummy", tp_size=2, context_length=2048, cuda_graph_max_bs=16
    ) as eng:
        outs = eng.generate(
            ["w5 w6 w7 w8"] * 8, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
        )
    assert all(len(o["output_ids"]) == 16 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) == 1  # same prompt, same greedy tokens
