"""DraftRunner on CUDA: proposals with the draft's decode steps replayed from CUDA graphs equal the
eager ones (greedy tokens, and the sampled rows' tokens and distributions), over two propose
rounds (the second with every request one token behind: step 0 replays a graph too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weft.runtime.config import EngineConfig
from weft.runtime.executor.batch import ForwardBatch, ForwardMode
from weft.runtime.executor.draft import DraftRunner, Proposal
from weft.runtime.executor.memory import PageAllocator, ReqToTokenPool
from weft.runtime.executor.sampler import SamplingInputs, make_generator
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
V, CTX, PAGE, K = 4096, 256, 16, 5
LAGS = [(30, 0), (70, 41), (9, 8), (120, 100), (3, 0)]  # (seq_len, draft_len)
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=50, sampling_seed=11),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.1, top_p=0.9, min_p=0.02, sampling_seed=12),
    SamplingParams(temperature=0.0),
]


def runner(model: Path, dtype: str, graphs: bool) -> DraftRunner:
    """A draft over a table of its own (each run admits its own requests)."""
    table = ReqToTokenPool(8, CTX, CUDA)
    tuning = {"gemv": "off", "graph_blas": "cublas"} if dtype == "float32" else {}
    config = EngineConfig.from_kwargs(model=str(model), device="cuda", dtype=dtype,
                                      max_running_requests=8, cuda_graph_max_bs=8,
                                      disable_cuda_graph=not graphs, tuning=tuning)  # fmt: skip
    return DraftRunner.build(config, model, CUDA, config.torch_dtype, table, PAGE, 64 * PAGE,
                             target_vocab_size=V)  # fmt: skip


def make_reqs(table: ReqToTokenPool, alloc: PageAllocator) -> list[Req]:
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i, (seq_len, draft_len) in enumerate(LAGS):
        ids = torch.randint(3, V, (seq_len,), generator=gen).tolist()
        req = Req(f"r{i}", ids, SamplingParams(max_new_tokens=64), max_new_tokens=64)
        req.kv_len, req.draft_len, req.row = seq_len - 1, draft_len, table.alloc()
        pages = alloc.alloc_pages(-(-(seq_len + 2 * K + 2) // PAGE))
        assert pages is not None and req.row is not None
        table.write(req.row, 0, alloc.page_slots(pages))
        reqs.append(req)
    table.flush()
    return reqs


def catch_up(draft: DraftRunner, table: ReqToTokenPool, reqs: list[Req]) -> None:
    runs = [(r, r.draft_len) for r in reqs if r.draft_len]
    lens = [n for _, n in runs]
    lens_t = torch.tensor(lens, device=CUDA)
    rows = torch.tensor([r.row for r, _ in runs], device=CUDA)
    pos = torch.cat([torch.arange(n, device=CUDA) for n in lens])
    ids = torch.tensor([t for r, n in runs for t in r.tokens(0, n)], device=CUDA)
    loc = table.table[torch.repeat_interleave(rows, lens_t), pos]
    draft.extend(ForwardBatch(ForwardMode.EXTEND, ids, pos, loc, rows, lens_t, lens_t, lens,
                              list(lens)))  # fmt: skip


def two_rounds(draft: DraftRunner) -> tuple[list[Proposal], int]:
    """Both propose rounds on fresh requests; how many draft forwards replayed a graph."""
    table = draft.table
    reqs = make_reqs(table, PageAllocator(64, PAGE, CUDA))
    catch_up(draft, table, reqs)
    replays = 0
    if draft.graphs is not None:
        replay = draft.graphs.replay

        def counted(fb: ForwardBatch) -> torch.Tensor:
            nonlocal replays
            replays += 1
            return replay(fb)

        draft.graphs.replay = counted
    out = []
    for _ in range(2):
        rows = [SamplingInputs(p, r.input_ids, r.output_ids, frozenset(),
                               make_generator(p.sampling_seed, CUDA) if p.sampling_seed else None)
                for p, r in zip(PARAMS, reqs, strict=True)]  # fmt: skip
        prop = draft.propose(reqs, K, rows)
        out.append(prop)
        for req, tokens in zip(reqs, prop.tokens, strict=True):  # accept 2, then a bonus token
            seq = req.seq_len
            req.output_ids += tokens[:2] + [(tokens[2] + 1) % V]
            req.kv_len, req.draft_len = seq + 2, seq + 2
    return out, replays


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_proposals_equal_eager(random_llama: Path, dtype: str) -> None:
    eager, n_eager = two_rounds(runner(random_llama, dtype, graphs=False))
    graph, n_graph = two_rounds(runner(random_llama, dtype, graphs=True))
    assert n_eager == 0 and n_graph == 2 * (K - 1) + 1  # round 2's step 0 is a decode too
    for e, g in zip(eager, graph, strict=True):
        if dtype == "float32":  # the same cuBLAS GEMMs: the same tokens
            assert g.tokens == e.tokens
        else:  # bf16: the graphs may run the skinny GEMV, rounding differently (a near tie may
            # flip a token, and a request's later tokens with it)
            same = sum(
                a == b
                for x, y in zip(e.tokens, g.tokens, strict=True)
                for a, b in zip(x, y, strict=True)
            )
            assert same >= 0.6 * len(LAGS) * K, (e.tokens, g.tokens)
        for pe, pg in zip(e.probs, g.probs, strict=True):
            assert (pe is None) == (pg is None)
            if pe is not None and pg is not None and dtype == "float32":
                torch.testing.assert_close(pg, pe, atol=1e-4, rtol=0)
                torch.testing.assert_close(pg.sum(-1), torch.ones(K, device=CUDA))
