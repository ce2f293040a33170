"""`kernel.py shared`: decode over a KV prefix shared by groups of requests, read once per group
(SharedPrefix) against once per request, with the prefix and own kernels' launches swept."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from kernel_util import (
    DEV,
    DIM,
    HEADS,
    KV_HEADS,
    decode_call,
    decode_setup,
    decode_splits,
    share_prefixes,
    time_ms,
)

FP8 = torch.float8_e4m3fn


def bench_shared(ceiling: float, fp8: bool, groups_list: list[int], own: int,
                 launches: bool) -> None:  # fmt: skip
    """Groups x 16 requests on a 2048-token prefix plus `own` keys each: the runtime's launches
    reading the prefix once per group against once per request; the roofline counts the prefix
    once. `launches`: sweeps of the prefix kernel's launch (the own kernel at the runtime's) and
    of the own kernel's (the prefix kernel at the runtime's), the best five of each."""
    from weft.kernels.shared_prefix import SharedPrefix
    from weft.runtime.executor.shared_prefix import prefix_splits

    size, prefix, kv_bytes = 16, 2048, 1 if fp8 else 2
    name = "fp8 e4m3" if fp8 else "bf16"
    print(f"\nshared-prefix decode, {name} pool, groups x {size} requests, prefix {prefix} + own "
          f"{own}")  # fmt: skip
    for groups in groups_list:
        bsz = groups * size
        args = decode_setup(bsz, prefix + own, FP8 if fp8 else torch.bfloat16)
        per_request = time_ms(decode_call(args, decode_splits(bsz, prefix + own, fp8)))
        blocks, starts = share_prefixes(args, groups, size, prefix)
        splits = decode_splits(bsz, own, fp8)
        nsplit = prefix_splits(prefix, groups, KV_HEADS)

        def run(prefix_launch: dict[str, int], own_launch: dict[str, int],
                blocks: dict[str, torch.Tensor] = blocks, args: dict[str, Any] = args,
                starts: torch.Tensor = starts, splits: int = splits, nsplit: int = nsplit) -> float:  # fmt: skip
            shared = SharedPrefix(**blocks, **{"num_splits": nsplit, **prefix_launch})
            return time_ms(decode_call(args, splits, kv_starts=starts, shared=shared, **own_launch))

        ours = run({}, {})
        ideal = (groups * prefix + bsz * own) * KV_HEADS * DIM * 2 * kv_bytes / (ceiling * 1e6)
        print(f"  {groups} groups (B={bsz}): per request {per_request * 1e3:7.1f} us, shared "
              f"{ours * 1e3:7.1f} us ({per_request / ours:.2f}x); roofline of shared "
              f"{ideal * 1e3:.1f} us ({ideal / ours:.0%}); {nsplit} prefix splits, {splits} own")  # fmt: skip
        if not launches:
            continue
        prefix_grid = [{"num_splits": sp, "block_n": bn, "num_warps": w, "num_stages": st}
                       for sp in (1, 2, 4) for bn in (64, 128) for w in (4, 8)
                       for st in (2, 3)]  # fmt: skip
        own_grid = [{"block_n": bn, "num_warps": w, "num_stages": st}
                    for bn in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3)]  # fmt: skip
        for kind, grid in (("prefix", prefix_grid), ("own", own_grid)):
            times = sorted((run(c, {}) if kind == "prefix" else run({}, c), i)
                           for i, c in enumerate(grid))  # fmt: skip
            best = ", ".join(f"{ms * 1e3:.1f} us {grid[i]}" for ms, i in times[:5])
            print(f"    {kind} kernel, best of {len(grid)}: {best}")


def bench_prefix_pools(ceiling: float) -> None:
    """The prefix kernel alone (64 groups x 16 on a 2048-token prefix) over a bf16 and an fp8
    pool, per keys per tile, warps and pipeline stages: us, TFLOP/s (4 * rows * keys * 128 per
    kv head) and % of its byte roofline (the prefix read once). Over bf16 it reads twice the
    bytes: whether the bytes, the fp8 conversion or the dots bound it."""
    from weft.kernels.shared_prefix import SharedPrefix, shared_prefix_splits
    from weft.runtime.executor.shared_prefix import prefix_splits

    groups, size, prefix, own = 64, 16, 2048, 160
    bsz = groups * size
    flops = 4 * bsz * HEADS * prefix * DIM
    print(
        f"\nthe prefix kernel alone, {groups} groups x {size} on {prefix}: us, TFLOP/s, % of bytes"
    )
    base = decode_setup(bsz, prefix + own)
    blocks, _ = share_prefixes(base, groups, size, prefix)
    splits = decode_splits(bsz, own)
    nsplit = prefix_splits(prefix, groups, KV_HEADS)
    width = splits + nsplit
    partials = (torch.empty(bsz, HEADS, width, DIM, dtype=torch.float32, device=DEV),
                torch.empty(bsz, HEADS, width, dtype=torch.float32, device=DEV))  # fmt: skip
    for name in ("bf16", "fp8"):
        k, v = base["k_buffer"], base["v_buffer"]
        if name == "fp8":
            k, v = k.to(FP8), v.to(FP8)
        nbytes = groups * prefix * KV_HEADS * DIM * 2 * k.element_size()
        for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
            cells = []
            for stages in (2, 3, 4):
                shared = SharedPrefix(**blocks, num_splits=nsplit, num_warps=warps,
                                      num_stages=stages)  # fmt: skip
                ms = time_ms(partial(shared_prefix_splits, base["q"], k, v, base["req_to_token"],
                                     shared, partials, base["scale"], splits, bn))  # fmt: skip
                cells.append(f"{stages} stages {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TF "
                             f"{nbytes / ms / 1e6 / ceiling:.0%}")  # fmt: skip
            print(f"  {name} pool, {bn} keys, {warps} warps: " + " | ".join(cells))
