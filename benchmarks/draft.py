"""The speculative draft model alone (DraftRunner.propose, no target): the time of one propose of k
tokens per batch size, decode steps replayed from CUDA graphs against eager.

    python benchmarks/draft.py                      # Qwen2.5-Coder-0.5B shape, bs 1 8 32 64
    python benchmarks/draft.py --variant "bf16:" --variant "gguf q4_k_m:quantization=gguf" \
        --batches 1 8 32 64 --k 4 --context 1024 --out /tmp/draft-bench

Dummy weights of a real config (default benchmarks/configs/qwen2.5-coder-0.5b, the draft of the
Qwen2.5-Coder pair), page size 16, --context tokens of KV per request. Two cases per batch:
`steady`, every request one token past its draft KV (step 0 is a decode: k decode forwards), and
`full accept`, every request two tokens past (what follows a verify that accepted all k drafts:
step 0 is a 2-token extend, then k - 1 decodes). Greedy rows (argmax, no distributions kept) unless
--sampled (temperature 0.8, top-p 0.95: distributions kept). Each propose ends by reading its tokens
on the host, so the figure is the whole call; CUDA events, the median of --reps after --warmup. On a
machine without CUDA (a tiny --config) it runs eagerly as a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_utils import Stopwatch, device_name, git_commit, markdown_table, merge_kwargs, parse_kv

from weft.runtime.config import EngineConfig
from weft.runtime.executor.draft import DraftRunner
from weft.runtime.executor.memory import PageAllocator, ReqToTokenPool
from weft.runtime.executor.sampler import SamplingInputs
from weft.runtime.loader import read_hf_config
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.request import Req

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "benchmarks/configs/qwen2.5-coder-0.5b"
CASES = {"steady": 1, "full accept": 2}  # tokens past the draft's KV at step 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, default=CONFIG, help="folder with a config.json")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--k", type=int, default=4, help="draft tokens per propose")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV per request")
    p.add_argument("--sampled", action="store_true", help="sampled rows instead of greedy")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:KEY=VALUE,... engine arguments of one variant (repeatable)")  # fmt: skip
    p.add_argument("--engine-arg", nargs="*", default=[], help="KEY=VALUE for every variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, help="folder for results.json and results.md")
    return p.parse_args(argv)


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for text in args.variant or ["default:"]:
        name, _, rest = text.partition(":")
        out.append((name, parse_kv([kv for kv in rest.split(",") if kv])))
    return out


def make_runner(
    args: argparse.Namespace, kwargs: dict[str, Any], graphs: bool
) -> tuple[DraftRunner, PageAllocator]:
    cuda = torch.cuda.is_available()
    base = {"model": str(args.config), "load_format": "dummy",
            "max_running_requests": max(args.batches), "cuda_graph_max_bs": max(args.batches),
            "context_length": args.context + 2 * args.k + 32, "disable_cuda_graph": not graphs,
            "device": "cuda" if cuda else "cpu"}  # fmt: skip
    config = EngineConfig.from_kwargs(**merge_kwargs(merge_kwargs(base, parse_kv(args.engine_arg)),
                                                     kwargs))  # fmt: skip
    device = torch.device(config.resolved_device)
    page = config.resolved_page_size
    ctx = config.context_length
    assert ctx is not None
    num_pages = max(args.batches) * -(-ctx // page) + 1
    table = ReqToTokenPool(max(args.batches), ctx, device)
    hf = read_hf_config(args.config)
    draft = DraftRunner.build(config, args.config, device, config.torch_dtype, table, page,
                              num_pages * page, target_vocab_size=hf.vocab_size)  # fmt: skip
    return draft, PageAllocator(num_pages, page, "cpu")


def run_batch(
    draft: DraftRunner, alloc: PageAllocator, args: argparse.Namespace, bs: int
) -> dict[str, float]:
    """Median ms per propose of each case for `bs` requests of --context tokens."""
    table, vocab = draft.table, draft.vocab_size
    gen = torch.Generator().manual_seed(bs)
    reqs = []
    for i in range(bs):
        ids = torch.randint(0, vocab, (args.context + 2,), generator=gen).tolist()
        req = Req(f"b{i}", ids, SamplingParams(max_new_tokens=64), max_new_tokens=64)
        req.row = table.alloc()
        pages = alloc.alloc_pages(-(-(args.context + 2 + args.k) // alloc.page_size))
        assert req.row is not None and pages is not None, "the pool is sized for every request"
        table.write(req.row, 0, alloc.page_slots(pages))
        req.kv_len = args.context + 1
        reqs.append(req)
    params = SamplingParams(temperature=0.8, top_p=0.95) if args.sampled else SamplingParams(
        temperature=0.0)  # fmt: skip
    rows = [SamplingInputs(params, r.input_ids, r.output_ids, frozenset()) for r in reqs]
    draft.propose(reqs, 1, rows)  # the prompts' KV (one extend)
    watch = Stopwatch(draft.device)
    out = {}
    for case, behind in CASES.items():
        times = []
        for rep in range(args.warmup + args.reps):
            for r in reqs:
                r.draft_len = r.seq_len - behind
            watch.start()
            draft.propose(reqs, args.k, rows)
            t = watch.stop()
            if rep >= args.warmup:
                times.append(t)
        out[case] = 1e3 * statistics.median(times)
    for r in reqs:
        assert r.row is not None
        alloc.free(table.cpu[r.row, : args.context + 2 + args.k])
        table.free(r.row)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    modes = [True, False] if torch.cuda.is_available() else [False]
    for name, kwargs in variants(args):
        for graphs in modes:
            draft, alloc = make_runner(args, kwargs, graphs)
            for bs in args.batches:
                for case, ms in run_batch(draft, alloc, args, bs).items():
                    results.append({"variant": name, "graphs": graphs, "batch": bs, "case": case,
                                    "k": args.k, "ms": ms, "ms_per_step": ms / args.k})  # fmt: skip
            del draft, alloc
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    head = ["variant", "graphs", "batch", "case", "k", "ms / propose", "ms / draft step"]
    table = markdown_table(head, [[r["variant"], "yes" if r["graphs"] else "no", r["batch"],
                                   r["case"], r["k"], round(r["ms"], 3),
                                   round(r["ms_per_step"], 3)] for r in results])  # fmt: skip
    title = (f"draft propose on {device_name()} (commit {git_commit()}), config "
             f"{args.config.name}, context {args.context}, "
             f"{'sampled' if args.sampled else 'greedy'}")  # fmt: skip
    print(f"{title}\n\n{table}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(f"{title}\n\n{table}\n")
    return results


if __name__ == "__main__":
    main()
