"""Our Llama-family modules over the paged KV pool vs HF transformers on tiny random configs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from weft.runtime.executor.attention import create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.memory import KVPool, PageAllocator, ReqToTokenPool
from weft.runtime.models import build_model, init_dummy_weights, model_class
from weft.runtime.models.layers import rope_inv_freq

VOCAB = 97
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def hf_config(kind: str) -> Any:
    if kind == "llama3.1":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return transformers.LlamaConfig(**COMMON, rope_scaling=rope, tie_word_embeddings=False)
    if kind == "llama-tied-mha":
        return transformers.LlamaConfig(
            **{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=False)
    raise AssertionError(kind)


KINDS = ["llama3.1", "llama-tied-mha", "qwen2", "qwen3", "mistral"]
ARCH = {
    "llama3.1": "LlamaForCausalLM",
    "llama-tied-mha": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


class PagedRequest:
    """One request's table row over a page allocator, as the scheduler would fill it."""

    def __init__(self, model: Any, config: Any, page_size: int, length: int) -> None:
        head_dim = model.layers[0].self_attn.head_dim
        num_pages = 64 // page_size + 1
        self.pool = KVPool(
            num_pages * page_size,
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim,
            torch.float32,
            "cpu",
        )
        self.table = ReqToTokenPool(2, 128, "cpu")
        alloc = PageAllocator(num_pages, page_size, "cpu")
        pages = alloc.alloc_pages(-(-length // page_size))
        assert pages is not None
        pages.reverse()  # non-contiguous, out of order: the table must be what is used
        self.table.table[1, :length] = alloc.page_slots(pages)[:length]
        self.attn = create_attention_backend("torch", "cpu", self.pool, self.table.table, page_size)

    def run(self, model: Any, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        n = end - start
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND if n > 1 else ForwardMode.DECODE,
            input_ids=ids[start:end],
            positions=torch.arange(start, end),
            out_cache_loc=self.table.table[1, start:end],
            req_rows=torch.tensor([1]),
            seq_lens=torch.tensor([end]),
            extend_lens=torch.tensor([n]),
            seq_lens_cpu=[end],
            extend_lens_cpu=[n],
        )
        self.attn.prepare(fb)
        with torch.no_grad():
            return model.compute_logits(model(fb, self.attn))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf_through_prefill_chunks_and_decode(kind: str, page_size: int) -> None:
    torch.manual_seed(0)
    config = hf_config(kind)
    config.architectures = [ARCH[kind]]
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = build_model(config, 128, torch.device("cpu"), torch.float32)
    model.load_weights(hf.state_dict().items())
    ids = torch.randint(0, VOCAB, (20,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    req = PagedRequest(model, config, page_size, 20)
    spans = [(0, 9), (9, 14), (14, 15), (15, 16), (16, 20)]  # chunks, decodes, a last chunk
    got = torch.cat([req.run(model, ids, s, e) for s, e in spans])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_ragged_batch_equals_requests_alone() -> None:
    """A prefill of one request and a decode of another in one padded batch."""
    torch.manual_seed(1)
    config = hf_config("qwen2")
    config.architectures = ["Qwen2ForCausalLM"]
    model = build_model(config, 128, torch.device("cpu"), torch.float32)
    init_dummy_weights(model, seed=3)
    pool = KVPool(64, 2, 2, 16, torch.float32, "cpu")
    table = ReqToTokenPool(4, 128, "cpu")
    table.table[0, :10] = torch.arange(1, 11)
    table.table[1, :6] = torch.arange(20, 26)
    attn = create_attention_backend("torch", "cpu", pool, table.table, 1)
    a = torch.randint(0, VOCAB, (10,))
    b = torch.randint(0, VOCAB, (6,))

    def step(rows: list[int], chunks: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        ids = torch.cat([t[s:e] for t, s, e in chunks])
        pos = torch.cat([torch.arange(s, e) for _, s, e in chunks])
        loc = torch.cat([table.table[r, s:e] for r, (_, s, e) in zip(rows, chunks, strict=True)])
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_rows=torch.tensor(rows),
            seq_lens=torch.tensor([e for _, _, e in chunks]),
            extend_lens=torch.tensor([e - s for _, s, e in chunks]),
            seq_lens_cpu=[e for _, _, e in chunks],
            extend_lens_cpu=[e - s for _, s, e in chunks],
        )
        attn.prepare(fb)
        with torch.no_grad():
            return model.compute_logits(model(fb, attn))

    alone_a = step([0], [(a, 0, 10)])
    step([1], [(b, 0, 5)])
    alone_b = step([1], [(b, 5, 6)])
    together = step([0, 1], [(a, 0, 10), (b, 5, 6)])  # rewrites the same KV: same values
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)


def test_llama3_rope_scaling_matches_transformers() -> None:
    config = hf_config("llama3.1")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    from weft.runtime.models.layers import rope_parameters

    got = rope_inv_freq(16, rope_parameters(config))
    torch.testing.assert_close(got, expected)


def test_unsupported_models_are_refused() -> None:
    config = transformers.GPT2Config()
    with pytest.raises(ValueError, match="unsupported model"):
        model_class(config)
    bad_rope = hf_config("llama3.1")
    bad_rope.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    bad_rope.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="yarn"):
        build_model(bad_rope, 128, torch.device("cpu"), torch.float32)


def test_load_weights_names_missing_and_misshaped_tensors() -> None:
    config = hf_config("llama3.1")
    config.architectures = ["LlamaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_config(config)
    model = build_model(config, 128, torch.device("cpu"), torch.float32)
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        model.load_weights(state.items())
    state = dict(hf.state_dict())
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights(state.items())


def test_dummy_weights_are_deterministic_and_finite() -> None:
    config = hf_config("qwen3")
    config.architectures = ["Qwen3ForCausalLM"]
    a = build_model(config, 128, torch.device("cpu"), torch.float32)
    b = build_model(config, 128, torch.device("cpu"), torch.float32)
    init_dummy_weights(a, seed=7)
    init_dummy_weights(b, seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    assert torch.all(a.norm.weight == 1)
