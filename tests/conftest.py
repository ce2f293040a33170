"""Shared fixtures: the packaged model's converted folder and a tiny random model built from it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def weft_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private model cache for the session (never the user's ~/.cache/weft)."""
    return tmp_path_factory.mktemp("weft-cache")


@pytest.fixture(scope="session")
def default_model_dir(weft_cache: Path) -> Path:
    """The packaged SmolLM2-135M-Instruct, converted once into the session cache."""
    from weft.runtime.loader import resolve_model_path

    return resolve_model_path(None, weft_cache)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: fast scheduler tests with real text."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def save_tiny_llama(folder: Path, tokenizer_dir: Path, **config: Any) -> Path:
    """A 2-layer random Llama (seed 0) over SmolLM2's vocabulary into `folder`, with the tokenizer
    files of `tokenizer_dir`; `config`: LlamaConfig fields to change."""
    import shutil

    import torch
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "architectures": ["LlamaForCausalLM"],
    }
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`weft serve` on the packaged SmolLM2 (one for the whole session), with the cache report."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    args = ["--model", str(default_model_dir), "--served-model-name", "smollm2"]
    proc = ServerProcess([*args, "--enable-cache-report"], log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
