"""Decode reading a shared prefix once per group (triton backend): the greedy tokens of requests
sharing a long prompt prefix equal those of reading it per request and of the torch backend, eager
and in CUDA graphs, with groups larger than one block. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import weft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prompts() -> list[str]:
    """Two groups sharing 320-word prefixes (one of 18 requests: two blocks), and loners."""
    first = " ".join(f"w{i}" for i in range(10, 330))
    second = " ".join(f"w{i}" for i in range(1000, 1320))
    out = [f"{first} w{2000 + i} w{2100 + i}" for i in range(18)]
    out += [f"{second} w{2200 + i}" for i in range(3)]
    out += [f"w{3000 + i} w{3100 + i} w{3200 + i}" for i in range(3)]
    return out


def run(folder: Path, **kwargs: Any) -> tuple[list[list[int]], int]:
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with weft.Engine(str(folder), device="cuda", dtype="float32", page_size=16, **kwargs) as eng:
        eng.generate(prompts()[:1], {**params, "max_new_tokens": 1})  # the first prefix cached
        outs = [o["output_ids"] for o in eng.generate(prompts(), params)]
        return outs, int(eng.get_state()["shared_prefix_steps"])


@pytest.mark.parametrize("eager", [True, False])
def test_shared_prefix_decode_gives_the_same_greedy_tokens(random_llama: Path, eager: bool) -> None:
    graphs = {"disable_cuda_graph": eager}
    reference, none = run(random_llama, attention_backend="torch", disable_cuda_graph=True)
    per_request, off = run(
        random_llama, attention_backend="triton", disable_shared_prefix_decode=True, **graphs
    )
    shared, steps = run(random_llama, attention_backend="triton", **graphs)
    print(json.dumps({"eager": eager, "shared_prefix_steps": steps}))
    assert none == 0 and off == 0
    assert steps >= 20, "decode steps did not read the shared prefixes once per group"
    assert per_request == reference
    assert shared == reference
