"""CUDA-graph decode replays give the eager decode's hidden states, padded batches included
(Triton and FlashInfer backends)."""

from __future__ import annotations

import pytest
import torch
import transformers

from weft.runtime.config import TuningConfig
from weft.runtime.executor.attention import create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.cuda_graph import GraphRunner
from weft.runtime.executor.memory import KVPool, ReqToTokenPool
from weft.runtime.models import build_model, init_dummy_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "backend, blas, gemv, pdl, b",
    [
        ("triton", "auto", "auto", True, 5),
        ("triton", "cublaslt", "off", True, 5),
        ("flashinfer", "auto", "off", True, 5),
        ("flashinfer", "auto", "on", True, 4),
        ("triton", "auto", "on", True, 3),
        ("triton", "cublas", "on", False, 1),
        ("triton", "auto", "auto", True, 1),
    ],
)
def test_graph_replay_equals_eager_decode(
    backend: str, blas: str, gemv: str, pdl: bool, b: int
) -> None:
    """(With every graph's GEMMs on cuBLASLt too, and on the path measured faster per size; with
    the skinny GEMV in the graphs of up to 16 rows, its launches and the RMSNorms' programmatic
    dependents or not, or where the step replays faster with it.) The model's modules are the
    same after capture: each graph's choices travel with its batch."""
    tuning = TuningConfig(graph_blas=blas, gemv=gemv, disable_pdl=not pdl)
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=2048, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    model = build_model(config, 2048, torch.device("cuda"), torch.bfloat16)
    init_dummy_weights(model, seed=0, std=0.05)
    model.use_kernels(pdl=pdl)  # as the runner does on CUDA: Triton norms, rotary, SiLU-and-mul
    pool = KVPool(16 * 1024, 2, 2, 128, torch.bfloat16, "cuda")
    table = ReqToTokenPool(8, 2048, "cuda")
    lens = [100, 7, 300, 64, 1][:b]
    for row, n in enumerate(lens):
        table.table[row, : n + 1] = torch.arange(16 + row * 1024, 16 + row * 1024 + n + 1)
    for layer in range(2):  # some KV for the prefix
        pool.k[layer].normal_()
        pool.v[layer].normal_()
    attn = create_attention_backend(backend, "cuda", pool, table.table, 16, tuning)
    graphs = GraphRunner(model, attn, 8, 512, torch.bfloat16, torch.device("cuda"), pad_row=0,
                         tuning=tuning)  # fmt: skip
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    graphs.capture()
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before
    assert set(graphs.blas) == set(graphs.sizes)
    assert blas == "auto" or set(graphs.blas.values()) == {blas}
    if gemv == "on":  # every projection shape, at every captured size the GEMV serves
        assert sorted(graphs.gemv) == [1, 2, 4, 8]
        assert all(len(plan.launches) == 4 for plan in graphs.gemv.values())
    if gemv == "off":
        assert not graphs.gemv
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.randint(0, 1024, (b,), device="cuda"),
        positions=torch.tensor(lens, device="cuda"),
        out_cache_loc=torch.stack([table.table[r, n] for r, n in enumerate(lens)]),
        req_rows=torch.arange(b, device="cuda"),
        seq_lens=torch.tensor([n + 1 for n in lens], device="cuda"),
        extend_lens=torch.ones(b, dtype=torch.int64, device="cuda"),
        seq_lens_cpu=[n + 1 for n in lens],
        extend_lens_cpu=[1] * b,
    )
    with torch.no_grad():
        attn.prepare(fb)
        eager = model(fb, attn).clone()
        replayed = graphs.replay(fb).clone()
        again = graphs.replay(fb).clone()
    torch.testing.assert_close(replayed, again, atol=0, rtol=0)  # replays are deterministic
    scale = eager.abs().max().item()
    assert (replayed - eager).abs().max().item() <= 0.02 * scale, "graph != eager decode"
