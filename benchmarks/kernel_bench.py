"""Kernel timings on CUDA: weft.kernels against the device-to-device copy ceiling of the same run.

    python benchmarks/kernel_bench.py [--quick | --decode-only | --shared-only | --small-decode |
                                  --extend-only [--quick] | --fp8-peer | --fp8-prefix |
                                  --prefix-pools]

Medians of CUDA-event timings after warm-up (triton.testing.do_bench, L2 flushed between runs), on
random data. GB/s counts the fewest bytes each kernel must move (every input read once, every
output written once), bytes read plus written, as the copy ceiling does.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial

import torch

Pool = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def random_pool(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cuda",
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


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn over repeated CUDA-event timings, after warm-up."""
    from triton.testing import do_bench

    fn()  # compile outside do_bench: a compile in its first call shrinks its repeat count
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, in GB/s."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src)) / 1e6


def decode_setup(bsz: int, kv_len: int, heads: int = 32, hkv: int = 8, dim: int = 128) -> dict:
    k_buffer, v_buffer, table, rows = random_pool([kv_len] * bsz, 16, hkv, dim, torch.bfloat16)
    return {
        "q": torch.randn(bsz, heads, dim, dtype=torch.bfloat16, device="cuda"),
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "req_to_token": table,
        "req_rows": rows,
        "seq_lens": torch.full((bsz,), kv_len, dtype=torch.int64, device="cuda"),
        "out": torch.empty(bsz, heads, dim, dtype=torch.bfloat16, device="cuda"),
        "scale": dim**-0.5,
    }


def decode_bytes(
    bsz: int, kv_len: int, heads: int = 32, hkv: int = 8, dim: int = 128, kv_bytes: int = 2
) -> int:
    kv = 2 * bsz * kv_len * hkv * dim * kv_bytes  # K and V
    return kv + bsz * kv_len * 8 + 2 * bsz * heads * dim * 2  # + slot indices, q, out


def bench_decode(ceiling: float, quick: bool) -> None:
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits_grid = [1, 2, 4, 8, 16, 32]
    print(f"\ndecode attention, kv 2048, 32 q / 8 kv heads, d=128, page 16, bf16 ({sms} SMs)")
    print("  GB/s per num_kv_splits (columns); * = decode_num_kv_splits' pick")
    print(f"  {'batch':>5} {'block_n':>7} " + " ".join(f"{s:>7}" for s in splits_grid))
    for bsz in [64] if quick else [1, 16, 64, 128]:
        args = decode_setup(bsz, 2048)
        pick = decode_num_kv_splits(bsz, 8, 2048, sms)
        nbytes = decode_bytes(bsz, 2048)
        for block_n in (32, 64):
            cells = []
            for splits in splits_grid:
                ms = time_ms(
                    partial(decode_attention, **args, num_kv_splits=splits, block_n=block_n)
                )
                mark = "*" if splits == pick else " "
                cells.append(f"{nbytes / ms / 1e6:>6.0f}{mark}")
            print(f"  {bsz:>5} {block_n:>7} " + " ".join(cells))
    args = decode_setup(64, 2048)
    splits = decode_num_kv_splits(64, 8, 2048, sms)
    for attempt in ("", " (again: the spread is noise)"):
        ms = time_ms(lambda: decode_attention(**args, num_kv_splits=splits))
        gbps = decode_bytes(64, 2048) / ms / 1e6
        print(f"  B=64 defaults (splits {splits}): {ms * 1e3:.1f} us, {gbps:.0f} GB/s = "
              f"{gbps / ceiling:.0%} of copy{attempt}")  # fmt: skip
    print("  (FlashInfer 0.5.3 on this shape: 140 us, 3.7-3.8 TB/s per DEVICE.md)")


def sweep_launches(
    args: dict, bsz: int, grid: list[tuple[int, int, int, int]]
) -> list[tuple[float, int, int, int, int]]:
    """decode_attention timed per (splits, block_n, warps, stages) of `grid`: (ms, *launch),
    fastest first; a launch that fails (out of shared memory etc.) is printed and skipped."""
    from weft.kernels.decode import decode_attention

    results = []
    for splits, block_n, warps, stages in grid:
        run = partial(
            decode_attention, **args, num_kv_splits=splits, block_n=block_n,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        try:
            ms = time_ms(run)
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.
            print(f"  B={bsz} {splits}/{block_n}/{warps}/{stages}: {type(e).__name__}")
            continue
        results.append((ms, splits, block_n, warps, stages))
    return sorted(results)


def bench_decode_tune(ceiling: float) -> None:
    """Stage-1 tile (block_n), warps, pipeline stages and split counts per batch size, each as
    a fraction of the copy ceiling; FlashInfer's tensor-core decode on the same data if installed."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\ndecode tuning, kv 2048, 32 q / 8 kv heads, d=128, page 16, bf16: % of copy ceiling")
    for bsz in (1, 8, 64, 256):
        args = decode_setup(bsz, 2048)
        nbytes = decode_bytes(bsz, 2048)
        pick = decode_num_kv_splits(bsz, 8, 2048, sms)
        grid = [
            (splits, block_n, warps, stages)
            for splits in sorted(
                {pick, 2 * pick, 4 * pick, 16, 32} if bsz <= 8 else {pick, 2 * pick}
            )
            for block_n in (32, 64, 128)
            for warps in (4, 8)
            for stages in (1, 2, 3, 4)
        ]
        results = sweep_launches(args, bsz, grid)
        default = time_ms(partial(decode_attention, **args, num_kv_splits=pick))
        best = ", ".join(
            f"{nbytes / ms / 1e6 / ceiling:.0%} (splits {sp}, block_n {bn}, warps {w}, stages {st})"
            for ms, sp, bn, w, st in results[:3]
        )
        print(f"  B={bsz:<3} default {default * 1e3:7.1f} us = {nbytes / default / 1e6 / ceiling:.0%}"
              f" | best: {best}")  # fmt: skip
        fi = flashinfer_decode_ms(args, bsz, 2048)
        if fi is not None:
            print(f"        FlashInfer tensor-core decode: {fi * 1e3:7.1f} us = "
                  f"{nbytes / fi / 1e6 / ceiling:.0%}")  # fmt: skip


def graph_ms(fns: Sequence[Callable[[], object]]) -> float:
    """Median ms per call of `fns` run back to back inside one CUDA graph: no launch or host cost,
    as in a decode step's replay (`time_ms` of eager calls is host-bound at small batches)."""
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


def bench_decode_small(ceiling: float) -> None:
    """Small decode batches inside a CUDA graph, as a decode step runs them: per split count and
    tile. One call per layer, each layer its own pool (>= 256 MB in all, so the L2 holds none of
    it, as between the layers of a model step)."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\ndecode in a CUDA graph, kv 2048, 32 q / 8 kv heads, d=128, page 16, bf16")
    print("  us per call and % of copy per num_kv_splits; * = pick for ctx 2048, g = pick for a"
          " graph captured at ctx 4096")  # fmt: skip
    splits_grid = [4, 8, 16, 32, 64]
    print(f"  {'batch':>5} {'block_n':>7} " + " ".join(f"{s:>13}" for s in splits_grid))
    for bsz in (1, 2, 4, 8, 16, 32):
        nbytes = decode_bytes(bsz, 2048)
        layers = max(1, min(32, (256 << 20) // nbytes))
        sets = [decode_setup(bsz, 2048) for _ in range(layers)]
        picks = (decode_num_kv_splits(bsz, 8, 2048, sms), decode_num_kv_splits(bsz, 8, 4096, sms))
        for block_n in (32, 64):
            cells = []
            for splits in splits_grid:
                fns = [
                    partial(decode_attention, **a, num_kv_splits=splits, block_n=block_n)
                    for a in sets
                ]
                ms = graph_ms(fns)
                mark = ("*" if splits == picks[0] else "") + ("g" if splits == picks[1] else "")
                cells.append(f"{ms * 1e3:5.1f} {nbytes / ms / 1e6 / ceiling:4.0%}{mark:<2}")
            print(f"  {bsz:>5} {block_n:>7} " + " ".join(cells))
        del sets
        torch.cuda.empty_cache()


def flashinfer_decode_ms(args: dict, bsz: int, kv_len: int) -> float | None:
    """FlashInfer 0.5.3's paged decode (tensor cores) over the same pool; None without it."""
    try:
        import flashinfer
    except ImportError:
        return None
    page = 16
    table, rows = args["req_to_token"], args["req_rows"]
    pages = (table[rows, :kv_len:page] // page).to(torch.int32).reshape(-1)
    npages = kv_len // page
    indptr = torch.arange(0, (bsz + 1) * npages, npages, dtype=torch.int32, device="cuda")
    last = torch.full((bsz,), page, dtype=torch.int32, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, pages, last, 32, 8, 128, page, q_data_type=torch.bfloat16,
                 kv_data_type=args["k_buffer"].dtype, sm_scale=args["scale"])  # fmt: skip
    shape = (-1, page, 8, 128)
    cache = (args["k_buffer"].view(shape), args["v_buffer"].view(shape))
    return time_ms(lambda: wrapper.run(args["q"], cache))


def share_prefixes(
    args: dict, groups: int, size: int, prefix: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Make each group of `size` consecutive requests of decode_setup's `args` read its leader's
    first `prefix` slots; SharedPrefix's block tensors for them, and the kv_starts."""
    table, rows = args["req_to_token"], args["req_rows"]
    members = torch.arange(groups * size, device="cuda").view(groups, size)
    for g in range(groups):
        table[rows[members[g, 1:]], :prefix] = table[rows[members[g, 0]], :prefix]
    blocks = {
        "block_members": members.to(torch.int32),
        "block_rows": rows[members[:, 0]].to(torch.int32),
        "block_lens": torch.full((groups,), prefix, dtype=torch.int32, device="cuda"),
    }
    return blocks, torch.full((groups * size,), prefix, dtype=torch.int32, device="cuda")


def bench_shared_prefix(ceiling: float) -> None:
    """Decode over a prefix shared by groups of requests: read once per group (SharedPrefix) vs
    once per request, at the runtime's split counts and a sweep of the prefix kernel's launch;
    the roofline counts the shared KV once."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.shared_prefix import SharedPrefix
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("\nshared-prefix decode, groups x 16 requests, prefix 2048 + own 256, bf16")
    for groups in (4, 16):
        bsz, prefix, own = groups * 16, 2048, 256
        args = decode_setup(bsz, prefix + own)
        blocks, starts = share_prefixes(args, groups, 16, prefix)
        splits = decode_num_kv_splits(bsz, 8, own, sms)
        plain = time_ms(partial(decode_attention, **args, num_kv_splits=decode_num_kv_splits(
            bsz, 8, prefix + own, sms)))  # fmt: skip
        ideal = (groups * prefix + bsz * own) * 8 * 128 * 2 * 2 / (ceiling * 1e6)
        configs: list[tuple[int, dict[str, int]]] = [
            (decode_num_kv_splits(groups, 8, prefix, sms), {})  # the runtime's pick
        ] + [
            (sp, {"block_n": bn, "num_warps": w, "num_stages": st})
            for sp in (2, 4, 8)
            for bn in (32, 64)
            for w in (4, 8)
            for st in (2, 3, 4)
        ]
        times = []
        for sp, launch in configs:
            shared = SharedPrefix(**blocks, num_splits=sp, **launch)
            run = partial(
                decode_attention, **args, num_kv_splits=splits, kv_starts=starts, shared=shared
            )
            times.append(time_ms(run))
        runtime = times[0]
        sweep = sorted(zip(times[1:], range(1, len(configs)), strict=True))
        best = ", ".join(f"{ms * 1e3:.1f} us (splits {configs[i][0]}, {configs[i][1]})"
                         for ms, i in sweep[:3])  # fmt: skip
        print(f"  {groups} groups (B={bsz}): per request {plain * 1e3:7.1f} us, shared "
              f"{runtime * 1e3:7.1f} us ({plain / runtime:.2f}x); roofline of shared "
              f"{ideal * 1e3:.1f} us | best: {best}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument(
        "--decode-only", action="store_true", help="only the decode tuning and shared-prefix runs"
    )
    parser.add_argument("--shared-only", action="store_true", help="only the shared-prefix runs")
    parser.add_argument("--fp8-tune", action="store_true", help="only the fp8-pool decode tuning")
    parser.add_argument(
        "--fp8-peer", action="store_true", help="only the fp8-pool decode next to FlashInfer's"
    )
    parser.add_argument(
        "--fp8-mid", action="store_true", help="only the fp8-pool decode at one to a few waves"
    )
    parser.add_argument(
        "--small-decode", action="store_true", help="only small decode batches in CUDA graphs"
    )
    parser.add_argument(
        "--extend-only", action="store_true", help="only extend attention, packed vs unpacked"
    )
    parser.add_argument(
        "--fp8-prefix", action="store_true", help="only the prefix-sharing decode on an fp8 pool"
    )
    parser.add_argument(
        "--extend-work", action="store_true", help="only extend attention, grid vs work list"
    )
    parser.add_argument(
        "--prefix-pools", action="store_true", help="only the prefix kernel, bf16 vs fp8 pool"
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "benchmarks/kernel_bench.py needs CUDA"
    torch.manual_seed(0)
    ceiling = copy_gbps()
    import triton

    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"device-to-device copy: {ceiling:.0f} GB/s (read + write)")
    if args.shared_only:
        bench_shared_prefix(ceiling)
        return
    if args.extend_work:
        from kernels_extend import bench_extend_work

        bench_extend_work()
        return
    if args.prefix_pools:
        from kernels_fp8 import bench_prefix_kernel_pools

        bench_prefix_kernel_pools(ceiling)
        return
    if args.fp8_prefix:
        from kernels_fp8 import bench_prefix_decode_fp8

        bench_prefix_decode_fp8(ceiling)
        return
    if args.fp8_mid:
        from kernels_fp8 import bench_decode_fp8_mid

        bench_decode_fp8_mid(ceiling)
        return
    if args.fp8_tune or args.fp8_peer:
        from kernels_fp8 import bench_decode_fp8_peer, bench_decode_fp8_tune

        (bench_decode_fp8_tune if args.fp8_tune else bench_decode_fp8_peer)(ceiling)
        return
    if args.small_decode:
        bench_decode_small(ceiling)
        return
    if args.extend_only:
        from kernels_extend import bench_extend

        bench_extend(args.quick)
        return
    if args.decode_only:
        bench_decode_tune(ceiling)
        bench_shared_prefix(ceiling)
        return
    from kernels_extend import bench_elementwise, bench_extend

    bench_decode(ceiling, args.quick)
    bench_extend(args.quick)
    bench_elementwise(ceiling)


if __name__ == "__main__":
    main()
