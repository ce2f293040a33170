"""End-to-end checks of the packaged SmolLM2 GGUF conversion against transformers' own GGUF load.

The conversion runs once per session into a temporary cache (never the user's ~/.cache/weft);
transformers' GGUF model (~30 s) and tokenizer are built once per module.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from weft.runtime.loader import iterate_weights, load_tokenizer, read_hf_config, resolve_model_path
from weft.runtime.loader.default_model import packaged_gguf

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What's 2+2? Réponds en français, s'il te plaît 🙂"},
    {"role": "assistant", "content": "Quatre."},
    {"role": "user", "content": "And in code?\n```python\nprint(2 + 2)\n```"},
]
TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "naïve café — 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
]


@pytest.fixture(scope="session")
def converted(weft_cache):
    start = time.perf_counter()
    folder = resolve_model_path(None, weft_cache)
    print(f"\nconverted the packaged GGUF in {time.perf_counter() - start:.1f} s -> {folder}")
    return folder


@pytest.fixture(scope="module")
def gguf_file():
    path = packaged_gguf().path
    return str(path.parent), path.name


@pytest.fixture(scope="module")
def reference_model(gguf_file):
    folder, name = gguf_file
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    print(f"\ntransformers loaded the GGUF in {time.perf_counter() - start:.1f} s")
    return model.eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    folder, name = gguf_file
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def test_tensors_equal_transformers_gguf_load(converted, reference_model):
    expected = reference_model.state_dict()
    ours = dict(iterate_weights(converted))
    assert reference_model.config.tie_word_embeddings
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied: stored once, as HF does
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == expected[name].shape, name
        # torch.equal first: allclose is ~10x slower on CPU and equal is what we expect
        assert torch.equal(tensor, expected[name]) or torch.allclose(
            tensor, expected[name], atol=1e-6, rtol=0
        ), name


def test_folder_loads_with_transformers(converted, reference_model, reference_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(
        converted, dtype=torch.float32, local_files_only=True
    )
    assert type(model) is type(reference_model)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = reference_tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours, ref = model(ids).logits, reference_model(ids).logits
    assert torch.allclose(ours, ref, atol=1e-5, rtol=0)


def test_config(converted, reference_model):
    config = read_hf_config(converted)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == 100000.0
    assert config.dtype == torch.float32
    assert not hasattr(config, "quantization_config")
    reference = reference_model.config.to_dict()  # AutoConfig's view of the GGUF
    # we set dtype and architectures; transformers' GGUF load adds quantization_config
    ignored = {"dtype", "torch_dtype", "architectures", "quantization_config"}
    ignored |= {"_name_or_path", "transformers_version"}
    ours = config.to_dict()
    assert {k: v for k, v in ours.items() if k not in ignored} == {
        k: v for k, v in reference.items() if k not in ignored
    }
    generation = GenerationConfig.from_pretrained(converted, local_files_only=True)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 2)


def test_tokenizer_matches_gguf_tokenizer(converted, reference_tokenizer):
    assert (converted / "chat_template.jinja").is_file() or "chat_template" in (
        converted / "tokenizer_config.json"
    ).read_text()
    ours = load_tokenizer(converted)
    ref = reference_tokenizer
    assert type(ours) is type(ref) and ours.is_fast
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref) == 49152
    assert ours.special_tokens_map == ref.special_tokens_map
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)
    assert (ours.pad_token_id, ours.unk_token, ours.unk_token_id) == (2, "<|endoftext|>", 0)
    for prompt in (True, False):
        text = ours.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt)
        assert text == ref.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=prompt
        )
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ids == ref(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == text
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids) == text


def test_second_resolve_reuses_folder(converted, weft_cache):
    """The converted folder is reused untouched (how long that takes: `python benchmarks/host.py
    resolve`)."""
    before = {p.name: p.stat().st_mtime_ns for p in [converted, *converted.iterdir()]}
    again = resolve_model_path(None, weft_cache)
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in [converted, *converted.iterdir()]} == before
    left = sorted(p.name for p in weft_cache.iterdir())  # no staging leftovers
    assert left == sorted([converted.name, f".{converted.name}.lock"])
