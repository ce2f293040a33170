"""Shared by the kernel benchmarks (benchmarks/kernel.py) and the CUDA kernel tests: random paged
KV pools, the timers (eager and inside a CUDA graph), the copy ceiling, decode-attention set-ups
and FlashInfer's decode as the peer.

tests/gpu/kernel_cases.py loads this file by path for `random_pool`: keep it importable without
the other benchmark modules."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

Pool = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16  # Llama-3.1-8B's attention, the GPU page size
# NOTE: CPU only for a smoke run under TRITON_INTERPRET=1 (small batches); timings mean nothing there
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_pool(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = DEV,
    poison: bool = False,
) -> Pool:
    """(k_buffer, v_buffer, req_to_token, req_rows) for requests of `lens` tokens on shuffled pages
    (page 0 reserved) at shuffled table rows. poison: unowned slots NaN, unused table entries -> 0."""
    pages_per = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages_per)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, dtype=dtype, device=device)
    v_buffer = torch.randn(shape, dtype=dtype, device=device)
    table = torch.zeros(len(lens) + 4, max(lens) + page_size, dtype=torch.int64, device=device)
    rows = torch.randperm(len(lens) + 4, device=device)[: len(lens)]
    pages = torch.randperm(num_pages - 1, device=device) + 1
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool, device=device)
    offsets = torch.arange(page_size, device=device)
    first = 0
    for b, n in enumerate(lens):
        mine = pages[first : first + pages_per[b]]
        first += pages_per[b]
        slots = (mine[:, None] * page_size + offsets).reshape(-1)[:n]  # [n]
        table[rows[b], :n] = slots
        owned[slots] = True
    if poison:
        k_buffer[~owned] = float("nan")
        v_buffer[~owned] = float("nan")
    return k_buffer, v_buffer, table, rows


##### Timers and the ceiling #####


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn over repeated CUDA-event timings after warm-up, the L2 flushed
    between calls (triton.testing.do_bench)."""
    from triton.testing import do_bench

    if DEV == "cpu":
        return _host_ms(fn)
    fn()  # compile outside do_bench: a compile in its first call shrinks its repeat count
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _host_ms(*fns: Callable[[], object]) -> float:
    """The CPU smoke run's timer: one call of each after one to warm up, ms per call."""
    for fn in fns:
        fn()
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    return (time.perf_counter() - t0) * 1e3 / len(fns)


def graph_ms(fns: Sequence[Callable[[], object]]) -> float:
    """Median ms per call of `fns` run back to back inside one CUDA graph: no launch or host cost,
    as in a decode step's replay (`time_ms` of eager calls is host-bound at small batches)."""
    if DEV == "cpu":
        return _host_ms(*fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_ms(graph.replay) / len(fns)


def share(nbytes: int, ms: float, ceiling_gbps: float) -> str:
    """'123.4 us 3,210 GB/s 76%': time, bandwidth and its share of the copy ceiling."""
    gbps = nbytes / ms / 1e6
    return f"{ms * 1e3:7.1f} us {gbps:6,.0f} GB/s {gbps / ceiling_gbps:4.0%}"


def num_sms() -> int:
    return int(torch.cuda.get_device_properties(0).multi_processor_count) if DEV == "cuda" else 4


##### Decode attention #####


def decode_setup(bsz: int, kv_len: int, kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """decode_attention's tensors for bsz requests of kv_len tokens (Llama-3.1-8B's heads, pages
    of 16), on a pool of `kv_dtype`."""
    k_buffer, v_buffer, table, rows = random_pool([kv_len] * bsz, PAGE, KV_HEADS, DIM,
                                                  torch.bfloat16)  # fmt: skip
    return {
        "q": torch.randn(bsz, HEADS, DIM, dtype=torch.bfloat16, device=DEV),
        "k_buffer": k_buffer.to(kv_dtype),
        "v_buffer": v_buffer.to(kv_dtype),
        "req_to_token": table,
        "req_rows": rows,
        "seq_lens": torch.full((bsz,), kv_len, dtype=torch.int64, device=DEV),
        "out": torch.empty(bsz, HEADS, DIM, dtype=torch.bfloat16, device=DEV),
        "scale": DIM**-0.5,
    }


def decode_bytes(bsz: int, kv_len: int, kv_bytes: int = 2) -> int:
    """The fewest bytes a decode call moves: K and V, the slot indices, q and out."""
    kv = 2 * bsz * kv_len * KV_HEADS * DIM * kv_bytes
    return kv + bsz * kv_len * 8 + 2 * bsz * HEADS * DIM * 2


def decode_call(args: dict[str, Any], splits: int, **plan: Any) -> Callable[[], torch.Tensor]:
    """decode_attention over `args` (decode_setup's) with a DecodePlan of `splits` and `plan`."""
    from weft.kernels.decode import DecodePlan, decode_attention

    return partial(decode_attention, **args, plan=DecodePlan(splits, **plan))


def decode_splits(bsz: int, kv_len: int, fp8: bool = False) -> int:
    """The runtime's split count for a batch (kernels/splits.py's model)."""
    from weft.kernels.splits import decode_num_kv_splits

    return decode_num_kv_splits(bsz, KV_HEADS, kv_len, num_sms(), fp8=fp8)


def sweep_launches(args: dict[str, Any], grid: list[tuple[int, int, int, int]],
                   timer: Callable[[Callable[[], object]], float] = time_ms,
                   ) -> list[tuple[float, int, int, int, int]]:  # fmt: skip
    """decode_attention timed per (splits, block_n, warps, stages) of `grid`: (ms, *launch),
    fastest first; a launch that fails (out of shared memory etc.) is printed and skipped."""
    results = []
    for splits, block_n, warps, stages in grid:
        run = decode_call(args, splits, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            ms = timer(run)
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.
            print(f"  {splits}/{block_n}/{warps}/{stages}: {type(e).__name__}")
            continue
        results.append((ms, splits, block_n, warps, stages))
    return sorted(results)


def flashinfer_decode_ms(args: dict[str, Any], bsz: int, kv_len: int) -> float | None:
    """FlashInfer's paged decode (tensor cores, the 0.5.3 API) over the same pool; None without
    it."""
    try:
        import flashinfer
    except ImportError:
        return None
    table, rows = args["req_to_token"], args["req_rows"]
    pages = (table[rows, :kv_len:PAGE] // PAGE).to(torch.int32).reshape(-1)
    npages = kv_len // PAGE
    indptr = torch.arange(0, (bsz + 1) * npages, npages, dtype=torch.int32, device=DEV)
    last = torch.full((bsz,), PAGE, dtype=torch.int32, device=DEV)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, pages, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16,
                 kv_data_type=args["k_buffer"].dtype, sm_scale=args["scale"])  # fmt: skip
    shape = (-1, PAGE, KV_HEADS, DIM)
    cache = (args["k_buffer"].view(shape), args["v_buffer"].view(shape))
    return time_ms(lambda: wrapper.run(args["q"], cache))


def share_prefixes(
    args: dict[str, Any], groups: int, size: int, prefix: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Make each group of `size` consecutive requests of decode_setup's `args` read its leader's
    first `prefix` slots; SharedPrefix's block tensors for them, and the kv_starts."""
    table, rows = args["req_to_token"], args["req_rows"]
    members = torch.arange(groups * size, device=DEV).view(groups, size)
    for g in range(groups):
        table[rows[members[g, 1:]], :prefix] = table[rows[members[g, 0]], :prefix]
    blocks = {
        "block_members": members.to(torch.int32),
        "block_rows": rows[members[:, 0]].to(torch.int32),
        "block_lens": torch.full((groups,), prefix, dtype=torch.int32, device=DEV),
    }
    return blocks, torch.full((groups * size,), prefix, dtype=torch.int32, device=DEV)


def graph_us(op: Callable[[], object], calls: int = 10, reps: int = 20) -> float:
    """Microseconds per call of `calls` calls back to back in one CUDA graph (no launch or host
    cost), the median of `reps` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            op()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
