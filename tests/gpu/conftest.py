"""Fixtures of the CUDA tests: a small random Llama saved as an HF folder with a word tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import save_word_tokenizer


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama (8 q / 2 kv heads of 32, untied) with a word-level tokenizer."""
    return _random_llama(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def random_llama_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with heads of 64 (FlashInfer's kernels take 64, 128 or 256)."""
    return _random_llama(tmp_path_factory, 512)


def _random_llama(tmp_path_factory: pytest.TempPathFactory, hidden: int) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("gpu-llama")
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_word_tokenizer(folder, 4096)
    return folder
