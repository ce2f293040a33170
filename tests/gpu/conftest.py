"""Fixtures of the CUDA tests: small random Llamas saved as HF folders, with a word tokenizer or a
byte-level one (for constrained outputs; the packaged model is not on the device)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import save_byte_tokenizer, save_word_tokenizer


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama (8 q / 2 kv heads of 32, untied) with a word-level tokenizer."""
    return _random_llama(tmp_path_factory, 256)


@pytest.fixture(scope="module")
def random_llama_d64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same with heads of 64 (FlashInfer's kernels take 64, 128 or 256)."""
    return _random_llama(tmp_path_factory, 512)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer random Llama over 512 ids with a byte-level tokenizer of 259: it can write any
    text, and its logit rows are wider than the tokenizer (the padded ids must stay masked)."""
    return _random_llama(tmp_path_factory, 256, vocab_size=512, tokenizer=save_byte_tokenizer)


def _random_llama(
    tmp_path_factory: pytest.TempPathFactory,
    hidden: int,
    vocab_size: int = 4096,
    tokenizer: Callable[[Path], object] | None = None,
) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("gpu-llama")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
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
    if tokenizer is None:
        save_word_tokenizer(folder, vocab_size)
    else:
        tokenizer(folder)
    return folder
