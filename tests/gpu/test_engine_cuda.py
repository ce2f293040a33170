"""The engine on CUDA (torch attention backend): exact greedy match with HF in float32 on a random
model, and a bf16 Llama-3.1-8B-shaped engine with dummy weights. Skipped without CUDA."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import weft
from tests.conftest import save_word_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("unfused", [False, True])
def test_fp32_cuda_greedy_equals_hf(random_llama: Path, unfused: bool) -> None:
    """With weft's Triton norm/rope/SiLU kernels (the CUDA default) and with torch ops."""
    import transformers

    prompts = ["w5 w6 w7", "w100 w200 w300 w400 w500", "w9", "w1000 w2000 w3000 w4000"]
    with weft.Engine(
        str(random_llama),
        device="cuda",
        dtype="float32",
        page_size=16,
        attention_backend="torch",
        disable_cuda_graph=True,
        disable_fused_kernels=unfused,
    ) as eng:
        outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        tok = eng.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(random_llama, dtype=torch.float32).cuda()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([tok.encode(prompt)], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            min_new_tokens=24,
        )
        assert out["output_ids"] == ref[0, ids.shape[1] :].tolist(), prompt


@pytest.mark.parametrize(
    ("backend", "eager"), [("auto", False), ("triton", True), ("flashinfer", True), ("torch", True)]
)
def test_bf16_llama8b_dummy_engine(tmp_path: Path, backend: str, eager: bool) -> None:
    """Loads the 8B shape with random weights straight onto the GPU and serves a batch."""
    import shutil

    folder = tmp_path / "llama-3.1-8b"
    folder.mkdir()
    shutil.copy(REPO / "benchmarks/configs/llama-3.1-8b/config.json", folder / "config.json")
    save_word_tokenizer(folder, 128256)
    start = time.perf_counter()
    with weft.Engine(
        str(folder),
        load_format="dummy",
        context_length=4096,
        mem_fraction=0.8,
        attention_backend=backend,
        disable_cuda_graph=eager,
    ) as eng:
        loaded = time.perf_counter() - start
        state: dict[str, Any] = eng.get_state()
        params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        eng.generate("warm up", {**params, "max_new_tokens": 4})
        t0 = time.perf_counter()
        outs = eng.generate([f"w{i + 10} w{i + 20} w{i + 30}" for i in range(8)], params)
        elapsed = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == 64 for o in outs)
    assert state["page_size"] == 16 and state["max_total_tokens"] > 100_000
    print(
        json.dumps(
            {
                "backend": backend,
                "load_s": round(loaded, 1),
                "batch8_64tok_s": round(elapsed, 2),
                **state,
            }
        )
    )
