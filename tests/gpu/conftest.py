"""Fixtures of the CUDA tests: a small random Llama saved as an HF folder with a word tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import save_word_tokenizer


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama (8 q / 2 kv heads, untied) with a word-level tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("gpu-llama")
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
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
