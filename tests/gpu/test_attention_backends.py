"""Every attention backend on CUDA gives the torch backend's logits (bf16 tolerance) through ragged
prefills over cached prefixes, a mixed step and decode steps, with page sizes 1 and 16. Skipped
without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from weft.runtime.executor.attention import available_backends, create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.memory import KVPool, PageAllocator, ReqToTokenPool
from weft.runtime.models import build_model, init_dummy_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BACKENDS = [
    b
    for b in available_backends()
    if b != "torch" and (b != "flashinfer" or importlib.util.find_spec("flashinfer") is not None)
]


def make_model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    model = build_model(config, 4096, torch.device("cuda"), torch.bfloat16)
    init_dummy_weights(model, seed=0, std=0.05)
    return model


def run_schedule(
    model: torch.nn.Module, backend: str, page_size: int, kv_dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """Three requests: ragged prefills in two chunks, a mixed step (one extends, two decode),
    then 2 decode steps; logits of each step (the KV pool in kv_dtype)."""
    torch.manual_seed(0)
    lens = [300, 37, 129]
    pool = KVPool(4096, 2, 2, 128, kv_dtype, "cuda")
    table = ReqToTokenPool(4, 4096, "cuda")
    alloc = PageAllocator(4096 // page_size, page_size, "cuda")
    for row, n in enumerate(lens):
        pages = alloc.alloc_pages(-(-(n + 8) // page_size))
        assert pages is not None
        table.table[row, : len(pages) * page_size] = alloc.page_slots(pages)
    attn = create_attention_backend(backend, "cuda", pool, table.table, page_size)
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 1024, (n + 6,), generator=gen) for n in lens]
    rows = torch.tensor([0, 1, 2], device="cuda")
    outs = []
    steps = [[(0, n // 2) for n in lens], [(n // 2, n) for n in lens]]
    # a mixed step (enable_mixed_chunk): request 0 extends 3 tokens, the others decode one
    steps.append([(n, n + (3 if r == 0 else 1)) for r, n in enumerate(lens)])
    starts = [n + (3 if r == 0 else 1) for r, n in enumerate(lens)]
    steps += [[(s + i, s + i + 1) for s in starts] for i in range(2)]
    for spans in steps:
        ids = torch.cat([t[s:e] for t, (s, e) in zip(tokens, spans, strict=True)]).cuda()
        pos = torch.cat([torch.arange(s, e) for s, e in spans]).cuda()
        loc = torch.cat([table.table[r, s:e] for r, (s, e) in enumerate(spans)])
        ext = [e - s for s, e in spans]
        seq = [e for _, e in spans]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if max(ext) == 1 else ForwardMode.EXTEND,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_rows=rows,
            seq_lens=torch.tensor(seq, device="cuda"),
            extend_lens=torch.tensor(ext, device="cuda"),
            seq_lens_cpu=seq,
            extend_lens_cpu=ext,
        )
        attn.prepare(fb)
        with torch.no_grad():
            outs.append(model.compute_logits(model(fb, attn)))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_torch_reference(backend: str, page_size: int) -> None:
    model = make_model()
    expected = run_schedule(model, "torch", page_size)
    got = run_schedule(model, backend, page_size)
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        err = (g - e).abs().max().item()
        scale = e.abs().max().item()
        assert err <= 0.02 * scale + 1e-2, f"step {step}: max err {err} (logit scale {scale})"
