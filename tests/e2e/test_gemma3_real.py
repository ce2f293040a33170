"""The real Gemma 3 270M (Q4_K_M GGUF, opt-in: skipped where the file is absent) through weft and
through HF's Gemma3ForCausalLM built from the same dequantized weights, float32 on CPU: greedy
tokens equal, incl. a prompt longer than the 512-token window; the kept-quantized path (weft
serve's default for a .gguf) equal to the dequantize-at-load one; the converted folder's config
and Gemma chat template. weft runs in process (the scheduler driven step by step) to keep the
test short on a small CPU.

Fetch the file with `shared/tools/fetch-models.sh gemma3-270m`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support import hf_greedy, scheduler_greedy

from weft.runtime.config import EngineConfig

MODELS = Path(os.environ.get("WEFT_MODELS", Path.home() / ".cache" / "weft-models"))
GGUF = MODELS.expanduser() / "gemma-3-270m-q4_k_m.gguf"
NEW = 32
WORDS = ("river stone lantern orchard copper meadow falcon harbor violet summit cedar ember "
         "glacier willow canyon thistle").split()  # fmt: skip
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    ",
    # ~640 tokens: past the sliding window (512), so local and global layers see different keys
    "Inventory log:\n"
    + "".join(f"{i}. {WORDS[i * 7 % 16]} {WORDS[i * 3 % 16]}, shelf {i % 13}\n" for i in range(58))
    + "The first item in the log was",
]

pytestmark = pytest.mark.skipif(
    not GGUF.is_file(), reason=f"{GGUF} is absent (shared/tools/fetch-models.sh gemma3-270m)"
)


@pytest.fixture(scope="module")
def folder(weft_cache: Path) -> Path:
    from weft.runtime.loader import resolve_model_path

    return resolve_model_path(str(GGUF), weft_cache)  # converted once (~35 s)


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Any:
    from weft.runtime.loader import load_tokenizer

    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    ids = [list(tokenizer.encode(p)) for p in PROMPTS]
    assert all(i[0] == 2 for i in ids)  # <bos>
    assert 560 < len(ids[-1]) < 700, len(ids[-1])
    return ids


@pytest.fixture(scope="module")
def weft_out(folder: Path, weft_cache: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    cfg = EngineConfig(model=str(GGUF), dequantize=True, cache_dir=str(weft_cache),
                       device="cpu", dtype="float32", max_total_tokens=4096)  # fmt: skip
    return scheduler_greedy(cfg, folder, prompt_ids, NEW)


def test_greedy_equals_hf_token_for_token(
    folder: Path, tokenizer: Any, prompt_ids: list[list[int]], weft_out: list[list[int]]
) -> None:
    import transformers

    hf = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompt_ids, NEW)
    assert weft_out == expected
    assert tokenizer.decode(weft_out[0]).startswith(" Berlin")  # the norms' +1 undone


def test_kept_quantized_equals_dequantized(
    folder: Path, weft_cache: Path, prompt_ids: list[list[int]], weft_out: list[list[int]]
) -> None:
    """`weft serve --model gemma.gguf`'s default: the Q5_0/Q8_0/Q4_K/Q6_K blocks kept (8 tokens
    of the short prompts: on CPU each step dequantizes every matrix)."""
    cfg = EngineConfig(model=str(GGUF), cache_dir=str(weft_cache), device="cpu",
                       dtype="float32", max_total_tokens=4096)  # fmt: skip
    assert cfg.resolved_quantization == "gguf"
    got = scheduler_greedy(cfg, folder, prompt_ids[:2], 8)
    assert got == [ids[:8] for ids in weft_out[:2]]


def test_converted_config_and_chat_template(folder: Path, tokenizer: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 256
    assert config["sliding_window"] == 512
    assert [i for i, k in enumerate(config["layer_types"]) if k == "full_attention"] == [5, 11, 17]
    rope = config["rope_parameters"]
    assert rope["sliding_attention"]["rope_theta"] == 10000.0
    assert rope["full_attention"]["rope_theta"] == 1_000_000.0
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106]  # <eos>, <end_of_turn>
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
