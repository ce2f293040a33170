"""One tensor-parallel rank for test_tp_sharding.py: build a sharded tiny model, write logits."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import transformers

from weft.runtime.executor.attention import create_attention_backend
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.distributed import TPGroup
from weft.runtime.executor.memory import KVPool, ReqToTokenPool
from weft.runtime.models import TPInfo, build_model, init_dummy_weights


def prefill_logits(
    model: Any, config: Any, ids: torch.Tensor, backend: str = "torch", gemv: Any = None
) -> torch.Tensor:
    """Logits of one prompt prefilled through a paged backend (torch's): [len(ids), vocab];
    `gemv`, a GemvPlan for the forward."""
    n = len(ids)
    attn_layer = model.layers[0].self_attn
    pool = KVPool(
        n + 1,
        config.num_hidden_layers,
        attn_layer.num_kv_heads,
        attn_layer.head_dim,
        torch.float32,
        "cpu",
    )
    table = ReqToTokenPool(1, 64, "cpu")
    table.table[0, :n] = torch.arange(1, n + 1)
    if backend == "triton":  # CUDA-only by name; its kernels run on CPU under TRITON_INTERPRET=1
        from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend

        attn: Any = TritonAttentionBackend(pool, table.table)
    else:
        attn = create_attention_backend(backend, "cpu", pool, table.table, 1)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids,
        positions=torch.arange(n),
        out_cache_loc=table.table[0, :n],
        req_rows=torch.tensor([0]),
        seq_lens=torch.tensor([n]),
        extend_lens=torch.tensor([n]),
        seq_lens_cpu=[n],
        extend_lens_cpu=[n],
        gemv=gemv,
    )
    attn.prepare(fb)
    with torch.no_grad():
        return model.compute_logits(model(fb, attn))


def main() -> None:
    """argv: rank, size, init method, JSON {case: {"config", "ids"}}, output file (rank 0)."""
    rank, size, init, specs_json, out = sys.argv[1:6]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=int(rank), world_size=int(size))
    tp = TPInfo(int(rank), int(size))
    results = {}
    for case, spec in json.loads(specs_json).items():
        config = transformers.AutoConfig.for_model(**spec["config"])
        model = build_model(config, 64, torch.device("cpu"), torch.float32, tp)
        init_dummy_weights(model, seed=5, std=0.2)
        results[case] = prefill_logits(model, config, torch.tensor(spec["ids"]))
    group = TPGroup(int(rank), int(size), torch.device("cpu"), None, dist.group.WORLD)
    group.check_agree(12345, "a value every rank holds")
    try:
        group.check_agree(int(rank), "the rank")  # differs: every rank must raise
        results["_diverged_raises"] = torch.tensor(0)
    except RuntimeError as e:
        results["_diverged_raises"] = torch.tensor(int("diverged from the others" in str(e)))
    if int(rank) == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    # Skip interpreter finalization: gloo's C++ threads can still be joinable while static
    # objects are destroyed, which aborts ("terminate called without an active exception")
    # about once in 25 runs after all the work above is done (torch issue 190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
