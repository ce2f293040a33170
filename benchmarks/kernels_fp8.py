"""The decode kernel on an fp8 (e4m3) KV pool: launch tuning, and FlashInfer's decode as the peer
(`python benchmarks/kernel_bench.py --fp8-tune | --fp8-peer`, on CUDA)."""

from __future__ import annotations

from functools import partial

import torch
from kernel_bench import (
    decode_bytes,
    decode_setup,
    flashinfer_decode_ms,
    graph_ms,
    share_prefixes,
    sweep_launches,
    time_ms,
)


def bench_decode_fp8_tune(ceiling: float) -> None:
    """The decode kernel on an fp8 (e4m3) pool at large batches (offline throughput's shapes):
    block_n, warps and stages around the defaults, as a fraction of the copy ceiling (KV bytes at
    1 byte per element); the bf16 pool's defaults on the same shape for comparison."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_len = 1536
    print(f"\ndecode tuning, fp8 e4m3 pool, kv {kv_len}, 32 q / 8 kv heads, d=128, page 16")
    for bsz in (64, 256, 512):
        args = decode_setup(bsz, kv_len)
        nbytes_bf16 = decode_bytes(bsz, kv_len)
        bf16 = time_ms(partial(decode_attention, **args, num_kv_splits=1))
        fp8 = torch.float8_e4m3fn
        args["k_buffer"] = args["k_buffer"].to(fp8)
        args["v_buffer"] = args["v_buffer"].to(fp8)
        nbytes = decode_bytes(bsz, kv_len, kv_bytes=1)
        pick = decode_num_kv_splits(bsz, 8, kv_len, sms)
        grid = [(pick, bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
        results = sweep_launches(args, bsz, grid)
        default = time_ms(partial(decode_attention, **args, num_kv_splits=pick))
        best = ", ".join(
            f"{ms * 1e3:.1f} us = {nbytes / ms / 1e6 / ceiling:.0%} (block_n {bn}, warps {w}, "
            f"stages {st})"
            for ms, _, bn, w, st in results[:3]
        )
        print(f"  B={bsz:<3} bf16 pool {bf16 * 1e3:7.1f} us = "
              f"{nbytes_bf16 / bf16 / 1e6 / ceiling:.0%} | fp8 default {default * 1e3:7.1f} us = "
              f"{nbytes / default / 1e6 / ceiling:.0%} | best: {best}")  # fmt: skip


def bench_decode_fp8_peer(ceiling: float) -> None:
    """weft's decode on an fp8 (e4m3) pool, V tiles converted where loaded (staged, the CUDA
    default) and sunk into the dot operand (the old way), next to FlashInfer's tensor-core decode
    on the same pool (the peer; it dequantizes in its kernel), and both on the bf16 pool, at
    offline throughput's batches; % of the copy ceiling counts the pool's bytes (1 per element
    for fp8). The staged kernel's launch is swept too; its output is checked against the old."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_len = 1536
    print(f"\ndecode, fp8 e4m3 vs bf16 pool, kv {kv_len}, 32 q / 8 kv heads, d=128, page 16")
    print("  us and % of copy: weft | FlashInfer 0.5.3 tensor-core decode")
    for bsz in (64, 256, 512):
        args = decode_setup(bsz, kv_len)
        pick = decode_num_kv_splits(bsz, 8, kv_len, sms)

        def cell(name: str, ms: float | None, nbytes: int) -> str:
            if ms is None:
                return f"{name} n/a"
            return f"{name} {ms * 1e3:6.1f} us = {nbytes / ms / 1e6 / ceiling:4.0%}"

        nbytes = decode_bytes(bsz, kv_len)
        row = [cell("bf16", time_ms(partial(decode_attention, **args, num_kv_splits=pick)), nbytes),
               cell("FI bf16", flashinfer_decode_ms(args, bsz, kv_len), nbytes)]  # fmt: skip
        args["k_buffer"] = args["k_buffer"].to(torch.float8_e4m3fn)
        args["v_buffer"] = args["v_buffer"].to(torch.float8_e4m3fn)
        nbytes = decode_bytes(bsz, kv_len, kv_bytes=1)
        outs = {}
        modes = {"sunk": {"fp8_v_staged": False}, "staged": {}}
        for mode, kw in modes.items():
            run = partial(decode_attention, **args, num_kv_splits=pick, **kw)
            row.append(cell(f"fp8 {mode}", time_ms(run), nbytes))
            outs[mode] = run().float().clone()
        row.append(cell("FI fp8", flashinfer_decode_ms(args, bsz, kv_len), nbytes))
        diff = (outs["staged"] - outs["sunk"]).abs().max().item()
        print(f"  B={bsz:<3} " + " | ".join(row) + f"  (staged vs sunk: max |diff| {diff:.2e})")
        grid = [(pick, bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
        results = sweep_launches(args, bsz, grid)
        print("        staged, best launches: " + ", ".join(
            f"{ms * 1e3:.1f} us = {nbytes / ms / 1e6 / ceiling:.0%} (block_n {bn}, warps {w}, "
            f"stages {st})" for ms, _, bn, w, st in results[:3]))  # fmt: skip


def bench_prefix_decode_fp8(ceiling: float) -> None:
    """Decode of the prefix-sharing benchmark's batch (64 groups x 16 requests on a 2048-token
    prefix, fp8 pool): the runtime's launch, then sweeps of the prefix kernel's launch (own kernel
    at its default) and of the per-request kernel's (prefix kernel at the runtime's); also with
    the block tensors padded to a CUDA graph's capacity at batch 1024 (128 blocks, half empty).
    The roofline counts the shared KV once and each request's own KV once, at 1 byte per element;
    the prefix kernel is also timed alone (the own kernel's share is the difference)."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.shared_prefix import SharedPrefix, shared_prefix_splits
    from weft.kernels.splits import decode_num_kv_splits
    from weft.runtime.executor.shared_prefix import max_blocks, prefix_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    groups, size, prefix = 64, 16, 2048
    bsz = groups * size
    print(f"\nprefix-sharing decode, fp8 pool, {groups} groups x {size}, prefix {prefix}")
    for own, padded in ((160, False), (160, True), (384, False)):
        args = decode_setup(bsz, prefix + own)
        args["k_buffer"] = args["k_buffer"].to(torch.float8_e4m3fn)
        args["v_buffer"] = args["v_buffer"].to(torch.float8_e4m3fn)
        blocks, starts = share_prefixes(args, groups, size, prefix)
        if padded:  # empty blocks up to the graph's capacity
            extra = max_blocks(bsz) - groups
            blocks = {
                "block_members": torch.cat([blocks["block_members"],
                                            blocks["block_members"].new_full((extra, size), -1)]),
                "block_rows": torch.cat([blocks["block_rows"], blocks["block_rows"][:extra] * 0]),
                "block_lens": torch.cat([blocks["block_lens"], blocks["block_lens"][:extra] * 0]),
            }  # fmt: skip
        nb = blocks["block_lens"].numel()
        splits = decode_num_kv_splits(bsz, 8, own, sms)
        runtime_splits = prefix_splits(prefix, nb, 8)
        ideal = (groups * prefix + bsz * own) * 8 * 128 * 2 / (ceiling * 1e6)

        fixed = {**args, "num_kv_splits": splits, "kv_starts": starts}

        def run(
            prefix_launch: dict,
            own_launch: dict,
            fixed: dict = fixed,
            blocks: dict = blocks,
            runtime_splits: int = runtime_splits,
        ) -> float:
            shared = SharedPrefix(**blocks, **{"num_splits": runtime_splits, **prefix_launch})
            return time_ms(partial(decode_attention, **fixed, shared=shared, **own_launch))

        base = run({}, {})
        shared = SharedPrefix(**blocks, num_splits=runtime_splits)
        width = splits + runtime_splits
        partials = (torch.empty(bsz, 32, width, 128, dtype=torch.float32, device="cuda"),
                    torch.empty(bsz, 32, width, dtype=torch.float32, device="cuda"))  # fmt: skip
        alone = time_ms(partial(
            shared_prefix_splits, args["q"], args["k_buffer"], args["v_buffer"],
            args["req_to_token"], shared, partials, args["scale"], splits, 128,
        ))  # fmt: skip
        prefix_ideal = groups * prefix * 8 * 128 * 2 / (ceiling * 1e6)
        print(f"  own {own}, {nb} blocks: runtime launch {base * 1e3:.1f} us (prefix splits "
              f"{runtime_splits}); roofline {ideal * 1e3:.1f} us ({ideal / base:.0%}); own "
              f"kernel splits {splits}; the prefix kernel alone {alone * 1e3:.1f} us (its "
              f"roofline {prefix_ideal * 1e3:.1f} us), so the own kernel "
              f"~{(base - alone) * 1e3:.1f} us (its roofline "
              f"{(ideal - prefix_ideal) * 1e3:.1f} us)")  # fmt: skip
        prefix_grid = [{"num_splits": sp, "block_n": bn, "num_warps": w, "num_stages": st}
                       for sp in (1, 2) for bn in (64, 128) for w in (4, 8)
                       for st in (2, 3)]  # fmt: skip
        own_grid = [{"block_n": bn, "num_warps": w, "num_stages": st}
                    for bn in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3)]  # fmt: skip
        for name, grid, as_prefix in (("prefix", prefix_grid, True), ("own", own_grid, False)):
            times = sorted((run(c, {}) if as_prefix else run({}, c), i) for i, c in enumerate(grid))
            best = ", ".join(f"{ms * 1e3:.1f} us {grid[i]}" for ms, i in times[:5])
            print(f"    {name} kernel, best of {len(grid)}: {best}")


def bench_prefix_kernel_pools(ceiling: float) -> None:
    """The shared-prefix kernel alone (64 groups x 16 on a 2048-token prefix, the runtime's
    launch) over a bf16 pool and an fp8 pool, per keys per tile, warps and pipeline stages: us,
    TFLOP/s (4 * rows * keys * 128 per kv head) and % of its byte roofline (the prefix read once).
    Whether the fp8 pool's conversion or the dots bound it: over bf16 it reads twice the bytes."""
    from weft.kernels.shared_prefix import SharedPrefix, shared_prefix_splits
    from weft.kernels.splits import decode_num_kv_splits
    from weft.runtime.executor.shared_prefix import prefix_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    groups, size, prefix, own = 64, 16, 2048, 160
    bsz = groups * size
    flops = 4 * bsz * 32 * prefix * 128
    print(
        f"\nthe prefix kernel alone, {groups} groups x {size} on {prefix}: us, TFLOP/s, % of bytes"
    )
    base = decode_setup(bsz, prefix + own)
    blocks, _ = share_prefixes(base, groups, size, prefix)
    splits = decode_num_kv_splits(bsz, 8, own, sms)
    nsplit = prefix_splits(prefix, groups, 8)
    partials = (torch.empty(bsz, 32, splits + nsplit, 128, dtype=torch.float32, device="cuda"),
                torch.empty(bsz, 32, splits + nsplit, dtype=torch.float32, device="cuda"))  # fmt: skip
    for pool in ("bf16", "fp8"):
        k, v = base["k_buffer"], base["v_buffer"]
        if pool == "fp8":
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        nbytes = groups * prefix * 8 * 128 * 2 * k.element_size()
        for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
            cells = []
            for stages in (2, 3, 4):
                shared = SharedPrefix(**blocks, num_splits=nsplit, num_warps=warps,
                                      num_stages=stages)  # fmt: skip
                ms = time_ms(partial(shared_prefix_splits, base["q"], k, v, base["req_to_token"],
                                     shared, partials, base["scale"], splits, bn))  # fmt: skip
                cells.append(f"{stages} stages {ms * 1e3:.1f} us "
                             f"{flops / ms / 1e9:.0f} TF {nbytes / ms / 1e6 / ceiling:.0%}")  # fmt: skip
            print(f"  {pool} pool, {bn} keys, {warps} warps: " + " | ".join(cells))


def bench_decode_fp8_mid(ceiling: float) -> None:
    """The decode kernel on an fp8 pool at small and middle batches (kv 2048), timed in CUDA
    graphs: per split count at the runtime's launch (the table the split model is fitted to,
    printed as a dict), and 64-key tiles at 1 and 2 splits."""
    from weft.kernels.decode import decode_attention
    from weft.kernels.splits import decode_num_kv_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_len = 2048
    print(f"\ndecode, fp8 e4m3 pool, kv {kv_len}, 32 q / 8 kv heads, in CUDA graphs")
    table: dict[int, dict[int, float]] = {}
    for bsz in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512):
        args = decode_setup(bsz, kv_len)
        for name in ("k_buffer", "v_buffer"):
            args[name] = args[name].to(torch.float8_e4m3fn)
        nbytes = decode_bytes(bsz, kv_len, kv_bytes=1)
        pick = decode_num_kv_splits(bsz, 8, kv_len, sms, fp8=True)
        table[bsz] = {
            s: round(graph_ms([partial(decode_attention, **args, num_kv_splits=s)]) * 1e3, 1)
            for s in (1, 2, 4, 8, 16, 32)
        }
        cells = [(table[bsz][s] / 1e3, s, 128, 3) for s in table[bsz]]
        for splits in (1, 2):
            ms = graph_ms([partial(decode_attention, **args, num_kv_splits=splits, block_n=64,
                                   num_warps=4, num_stages=2)])  # fmt: skip
            cells.append((ms, splits, 64, 2))
        cells.sort()
        best = ", ".join(f"{ms * 1e3:.1f} us = {nbytes / ms / 1e6 / ceiling:.0%} (splits {s}, "
                         f"block_n {bn}, stages {st})" for ms, s, bn, st in cells[:3])  # fmt: skip
        picked = table[bsz][pick] / 1e3
        print(f"  B={bsz:<3} picked {pick} splits {picked * 1e3:7.1f} us = "
              f"{nbytes / picked / 1e6 / ceiling:.0%} | best: {best}")  # fmt: skip
    print("per split count, the runtime's launch (us):")
    for bsz, times in table.items():
        print(f"    {bsz}: {times},")
