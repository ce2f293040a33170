"""Mixed chunked prefill (`enable_mixed_chunk`): a prefill step also runs one token of every running
request. Same greedy outputs as unmixed (overlap on and off, with grammars, jump-forward and
retraction), mixed steps really happen, KV slots are conserved; the triton backend's split of a
mixed batch (extend kernel for the prefills, decode kernel for the 1-token tail) gives the torch
backend's attention (TRITON_INTERPRET=1, in a child process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_overlap_schedule import SCHEMA, greedy, run

from weft.runtime.executor.batch import ForwardMode
from weft.runtime.sampling_params import SamplingParams

HERE = Path(__file__).resolve().parent
CHUNKED = {"page_size": 4, "chunked_prefill_size": 8, "max_prefill_tokens": 16}


def params_mix() -> list[SamplingParams]:
    params = []
    for i in range(10):
        if i % 3 == 1:
            params.append(greedy(40, json_schema=json.dumps(SCHEMA)))
        elif i % 3 == 2:
            params.append(greedy(14, frequency_penalty=0.5, ignore_eos=True))
        else:
            params.append(greedy(6 + 2 * i, ignore_eos=True))
    return params


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"disable_jump_forward": True}, {"max_total_tokens": 160}, {"disable_radix_cache": True}],
    ids=["plain", "no-jump-forward", "retraction", "no-radix-cache"],
)
def test_mixed_steps_give_the_unmixed_outputs(
    tiny_model_dir: Path, overlap: str, extra: dict[str, Any]
) -> None:
    params = params_mix()
    plain, s_plain = run(tiny_model_dir, overlap, params, **CHUNKED, **extra)
    modes: list[ForwardMode] = []
    mixed, s_mixed = run(
        tiny_model_dir, overlap, params, modes=modes, enable_mixed_chunk=True, **CHUNKED, **extra
    )
    assert mixed == plain
    assert s_plain.stats["mixed_steps"] == 0
    assert s_mixed.stats["mixed_steps"] >= 3, s_mixed.stats
    # the running requests decoded inside prefill steps: fewer steps in all
    assert len(modes) < s_plain.runner.num_forward_passes, (len(modes), s_plain.stats)


CHILD = r"""
import json, os, sys
import torch
from weft.runtime.config import TuningConfig
from weft.runtime.executor.attention import _REGISTRY
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.memory import KVPool, PageAllocator, ReqToTokenPool
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # test_kernels, support
from test_kernels import _patch_old_interpreter
_patch_old_interpreter()
torch.manual_seed(0)
page, heads, hkv, dim = 4, 4, 2, 16
lens = [(0, 9), (5, 12), (30, 31), (17, 18), (3, 4)]  # (cached, after): 2 prefills, 3 decodes
out = {}
for backend in ("torch", "triton"):
    torch.manual_seed(0)
    pool = KVPool(256, 1, hkv, dim, torch.float32, "cpu")
    table = ReqToTokenPool(8, 64, "cpu")
    alloc = PageAllocator(256 // page, page, "cpu")
    for row, (_, n) in enumerate(lens):
        pages = alloc.alloc_pages(-(-n // page))
        table.table[row, : len(pages) * page] = alloc.page_slots(pages)
        cached = lens[row][0]
        slots = table.table[row, :cached]
        pool.k[0][slots] = torch.randn(cached, hkv, dim)
        pool.v[0][slots] = torch.randn(cached, hkv, dim)
    tuning = TuningConfig(extend_work=sys.argv[2])
    attn = _REGISTRY[backend](pool, table.table, page, tuning)  # (its name check wants CUDA)
    ext = [e - s for s, e in lens]
    seq = [e for _, e in lens]
    t = sum(ext)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(s, e) for s, e in lens]),
        out_cache_loc=torch.cat([table.table[r, s:e] for r, (s, e) in enumerate(lens)]),
        req_rows=torch.arange(len(lens)), seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext),
        seq_lens_cpu=seq, extend_lens_cpu=ext,
    )
    attn.prepare(fb)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, hkv, dim), torch.randn(t, hkv, dim)
    o = attn.forward(q, k, v, 0, fb, dim ** -0.5)
    out[backend] = o
    if backend == "triton":
        split = (attn.num_extend, attn.extend_tokens)
        listed = None if attn.work is None else attn.work.tolist()
err = (out["triton"] - out["torch"]).abs().max().item()
print("RESULT " + json.dumps({"err": err, "split": split, "work": listed}))
"""


@pytest.mark.parametrize("work", ["off", "on"], ids=["grid", "work-list"])
def test_triton_backend_splits_a_mixed_batch(work: str) -> None:
    """Its prefills run the extend kernel over the full grid or a work list (tuning.extend_work)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(HERE), work], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["split"] == [2, 16], result  # the 2 prefills (9 + 7 tokens), then 3 decodes
    # fp32 tiles of 32 tokens: one block each, the one with more keys (5 + 7) first
    assert result["work"] == (None if work == "off" else [[1, 0], [0, 0]]), result
    assert result["err"] < 1e-4, result


def test_triton_backend_takes_the_work_list_by_default_on_an_fp8_pool() -> None:
    """The work list is the default where it was measured to win (an fp8 pool), the grid over
    16-bit pools; tuning.extend_work forces either, and a bad value is refused."""
    pytest.importorskip("triton")
    import torch

    from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend
    from weft.runtime.executor.memory import FP8_KV, KVPool

    def uses_work(dtype: torch.dtype, mode: str = "auto") -> bool:
        pool = KVPool(32, 1, 2, 16, dtype, "cpu")
        table = torch.zeros(4, 32, dtype=torch.int32)
        return TritonAttentionBackend(pool, table, extend_work=mode).use_work

    assert uses_work(FP8_KV) and not uses_work(torch.bfloat16)
    assert not uses_work(FP8_KV, "off")
    assert uses_work(torch.bfloat16, "on")
    with pytest.raises(ValueError, match="extend_work must be 'auto', 'on' or 'off'"):
        uses_work(torch.bfloat16, "yes")
