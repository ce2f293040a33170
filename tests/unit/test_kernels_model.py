"""The model with weft's Triton kernels (RMSNorm + residual, rotary, SiLU-and-mul, the skinny GEMV
projections, decode attention that rotates q and k) wired in gives the logits of its torch-op path: run on CPU under TRITON_INTERPRET=1 in
a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not importable: the kernels cannot run")

HERE = Path(__file__).resolve().parent
CHILD = r"""
import json, os, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # test_kernels, support
import torch, transformers
from test_kernels import _patch_old_interpreter
from tp_worker import prefill_logits
from weft.runtime.executor.attention import triton_backend
from weft.kernels import skinny
from weft.runtime.models import build_model, init_dummy_weights
from weft.runtime.models.layers import GemvPlan, Projection, RMSNorm

_patch_old_interpreter()
torch.set_num_threads(1)


def decode_last_logits(model, config, ids):
    # ids[:-1] prefilled, then ids[-1] decoded, both on the triton backend: the decode step's
    # logits [1, vocab], and how many decode launches rotated q and k themselves (rope)
    from weft.runtime.executor.batch import ForwardBatch, ForwardMode
    from weft.runtime.executor.memory import KVPool, ReqToTokenPool
    n, attn_layer = len(ids), model.layers[0].self_attn
    pool = KVPool(n + 1, config.num_hidden_layers, attn_layer.num_kv_heads, attn_layer.head_dim,
                  torch.float32, "cpu")
    table = ReqToTokenPool(1, 64, "cpu")
    table.table[0, :n] = torch.arange(1, n + 1)
    attn = triton_backend.TritonAttentionBackend(pool, table.table)
    rotating, hints, real = [], [], triton_backend.decode_attention
    o_weights = [m.self_attn.o_proj.weight for m in model.layers]  # the decode calls' order
    def spy(*a):
        plan = a[-1]
        rotating.append(plan.rope is not None)
        hint, i = plan.l2_prefetch, len(hints)
        hints.append(hint is not None and i < len(o_weights) and hint.data is o_weights[i])
        return real(*a)
    triton_backend.decode_attention = spy
    logits = None
    for mode, lo, hi in ((ForwardMode.EXTEND, 0, n - 1), (ForwardMode.DECODE, n - 1, n)):
        fb = ForwardBatch(mode=mode, input_ids=ids[lo:hi], positions=torch.arange(lo, hi),
                          out_cache_loc=table.table[0, lo:hi], req_rows=torch.tensor([0]),
                          seq_lens=torch.tensor([hi]), extend_lens=torch.tensor([hi - lo]),
                          seq_lens_cpu=[hi], extend_lens_cpu=[hi - lo])
        attn.prepare(fb)
        with torch.no_grad():
            logits = model.compute_logits(model(fb, attn))
    triton_backend.decode_attention = real
    return logits, sum(rotating), sum(hints)

base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "max_position_embeddings": 64, "vocab_size": 101, "head_dim": 16}
cases = {
    "llama": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2,
              "architectures": ["LlamaForCausalLM"],
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "qwen3": {"model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2,
              "architectures": ["Qwen3ForCausalLM"]},
}
out = {}
ids = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(3))
for name, cfg in cases.items():
    config = transformers.AutoConfig.for_model(**base, **cfg)
    model = build_model(config, 64, torch.device("cpu"), torch.float32)
    init_dummy_weights(model, seed=2, std=0.2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms of their own, not 1 (dummy weights leave them so)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.mul_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
    ref = prefill_logits(model, config, ids)
    model.use_kernels()
    got = prefill_logits(model, config, ids)
    out[name] = {"max_abs": (got - ref).abs().max().item(), "scale": ref.abs().max().item()}
    # the triton backend lends the pool: the rotary kernel stores k and v, store_kv never runs
    stores = []
    real_store = triton_backend.store_kv
    triton_backend.store_kv = lambda *a: stores.append(1) or real_store(*a)
    got = prefill_logits(model, config, ids, backend="triton")
    triton_backend.store_kv = real_store
    out[name + "+triton"] = {"max_abs": (got - ref).abs().max().item(),
                             "scale": ref.abs().max().item(), "store_kv_calls": len(stores)}
    # the last token decoded: the decode kernel rotates q and k and stores k and v itself
    got, rotating, hints = decode_last_logits(model, config, ids)
    out[name + "+decode"] = {"max_abs": (got - ref[-1:]).abs().max().item(),
                             "scale": ref[-1:].abs().max().item(), "rotating_calls": rotating,
                             "o_proj_prefetch_hints": hints}
    # three tokens: every projection through the GEMV (down with SiLU-and-mul inside it), as a
    # GemvPlan of the forward names them; the model itself is not modified
    ref = prefill_logits(model, config, ids[:3])
    real_gemv = skinny.gemv
    projections = [m for m in model.modules() if isinstance(m, Projection)]
    plan = GemvPlan({m.shape: skinny.GemvLaunch(16, 16, 2, 4, 2) for m in projections})
    calls = []
    skinny.gemv = lambda *a, **k: calls.append(k) or real_gemv(*a, **k)
    got = prefill_logits(model, config, ids[:3], gemv=plan)
    skinny.gemv = real_gemv
    out[name + "+gemv"] = {
        "max_abs": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
        "gemv_calls": len(calls), "projections": len(projections),
        "gated_calls": sum(k.get("silu_mul", False) for k in calls)}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def diffs() -> dict[str, dict[str, float]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(HERE)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, dict[str, float]] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@pytest.mark.parametrize(
    "kind",
    ["llama", "qwen3", "llama+triton", "qwen3+triton", "llama+decode", "qwen3+decode",
     "llama+gemv", "qwen3+gemv"],
)  # fmt: skip
def test_kernels_give_the_torch_logits(kind: str, diffs: dict[str, dict[str, float]]) -> None:
    """(+triton: the triton attention backend, into whose pool the rotary kernel stores k and v
    in its own launch; +decode: the last token decoded on it, where the decode kernel rotates q
    and k and stores k and v, once per layer, and is handed the layer's o_proj weight to prefetch
    into the L2 (a hint the interpreter ignores); +gemv: every projection on the skinny GEMV, as
    the forward's GemvPlan names them.)"""
    d = diffs[kind]
    assert d.get("store_kv_calls", 0) == 0
    if kind.endswith("+decode"):  # each layer's launch also asked to prefetch its o_proj weight
        assert d["rotating_calls"] == d["o_proj_prefetch_hints"] == 2, d
    if kind.endswith("+gemv"):  # each projection once, down with the activation
        assert d["gemv_calls"] == d["projections"] == 8, d
        assert d["gated_calls"] == 2, d
    assert d["scale"] > 0.1  # the logits are not trivially zero
    assert d["max_abs"] < 1e-4 * d["scale"] + 1e-5, d
