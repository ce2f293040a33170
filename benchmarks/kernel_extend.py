"""`kernel.py extend`: extend (prefill) attention over a paged prefix: packed GQA against one
program per q head, launch sweeps, and the grid against a work list of query blocks."""

from __future__ import annotations

from functools import partial

import torch
from kernel_util import DEV, random_pool, time_ms


def extend_setup(
    bsz: int, prefix: int, ext: int, kv_dtype: torch.dtype = torch.bfloat16, share: int = 1
) -> tuple:
    """extend_attention's positional arguments for bsz requests of `prefix` cached + `ext` new
    tokens, 32 q / 8 kv heads, d=128, page 16, bf16 queries; every `share` requests read their
    first one's prefix slots, as requests under one radix-cache prefix do."""
    k_buffer, v_buffer, table, rows = random_pool([prefix + ext] * bsz, 16, 8, 128, torch.bfloat16)
    if share > 1:
        leaders = rows[::share].repeat_interleave(share)[:bsz]
        table[rows, :prefix] = table[leaders, :prefix]
    k_buffer, v_buffer = k_buffer.to(kv_dtype), v_buffer.to(kv_dtype)
    tokens = bsz * ext
    q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=DEV)
    v = torch.randn_like(k)
    lens = torch.full((bsz,), ext, dtype=torch.int64, device=DEV)
    pre = torch.full((bsz,), prefix, dtype=torch.int64, device=DEV)
    start = torch.cumsum(lens, 0) - lens
    out = torch.empty_like(q)
    return (q, k, v, k_buffer, v_buffer, table, rows, pre, lens, start, out, 128**-0.5, ext)


def bench_extend(launches: bool) -> None:
    """Packed (a kv head's 4 q heads in one program, each K/V tile loaded once for them) against
    one program per q head, at their default launches, then (`launches`) a sweep of each."""
    from weft.kernels.extend import extend_attention

    print("\nextend attention, 32 q / 8 kv heads, d=128, page 16, bf16 q: TFLOP/s (causal FLOPs)")
    shapes = [  # batch, cached prefix, new tokens, pool dtype, requests per shared prefix
        (8, 0, 2048, torch.bfloat16, 1),
        (8, 1024, 1024, torch.bfloat16, 1),
        (64, 2048, 128, torch.bfloat16, 1),
        (64, 2048, 128, torch.bfloat16, 16),
        (64, 2048, 128, torch.float8_e4m3fn, 1),
        (64, 2048, 128, torch.float8_e4m3fn, 16),
    ]
    sweep = [  # (pack_gqa, block_m, block_n, num_warps); block_m counts rows (token x head packed)
        (pack, bm, bn, w)
        for pack in (False, True)
        for bm, bn, w in ((64, 64, 4), (64, 64, 8), (128, 32, 8), (128, 64, 8), (128, 128, 8))
    ]
    for bsz, prefix, ext, kv_dtype, share in shapes:
        args = extend_setup(bsz, prefix, ext, kv_dtype, share)
        pairs = bsz * (ext * prefix + ext * (ext + 1) // 2)  # (query, key) pairs
        flops = 4 * 128 * 32 * pairs
        pool = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
        shared = f", shared by {share}," if share > 1 else ""
        label = f"{bsz} x ({prefix} cached{shared} + {ext} new), {pool} pool"
        cells, outs = [], []
        for pack in (False, True):
            ms = time_ms(partial(extend_attention, *args, pack_gqa=pack))
            outs.append(args[10].clone())
            cells.append((ms, f"{'packed' if pack else 'unpacked'} {ms * 1e3:8.1f} us "
                              f"{flops / ms / 1e9:6.1f} TFLOP/s"))  # fmt: skip
        diff = (outs[0].float() - outs[1].float()).abs().max().item()
        print(f"  {label}: {cells[0][1]} | {cells[1][1]} | packed {cells[0][0] / cells[1][0]:.2f}x"
              f" as fast (max |packed - unpacked| {diff:.1e})")  # fmt: skip
        if not launches:
            continue
        results = []
        for pack, bm, bn, w in sweep:
            run = partial(
                extend_attention, *args, block_m=bm, block_n=bn, num_warps=w, pack_gqa=pack
            )
            try:
                results.append((time_ms(run), pack, bm, bn, w))
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                print(f"    {'packed' if pack else 'unpacked'} {bm}x{bn} w{w}: {type(e).__name__}")
        for pack in (False, True):
            best = ", ".join(
                f"{flops / ms / 1e9:.0f} ({bm}x{bn} w{w})"
                for ms, p, bm, bn, w in sorted(results) if p == pack
            )  # fmt: skip
            print(f"    {'packed' if pack else 'unpacked':>8} TFLOP/s by launch: {best}")


def bench_extend_work() -> None:
    """The grid of every request x its longest request's query blocks against a work list of
    just the blocks with new tokens, heaviest first (extend_work), on batches the prefix-sharing
    and offline runs make: TFLOP/s counting causal FLOPs."""
    from weft.kernels.extend import extend_attention, extend_block_tokens, extend_work

    print("\nextend attention, grid vs work list, 32 q / 8 kv heads, d=128, page 16: TFLOP/s")
    shapes = [  # label, [(cached, new)] per request, pool dtype, requests per shared prefix
        ("a leader 2176 new + 46 followers 2048 cached + 128", [(0, 2176)] + [(2048, 128)] * 46),
        ("8 x 2048 new", [(0, 2048)] * 8),
        ("64 x (2048 cached + 128)", [(2048, 128)] * 64),
        ("4 x 2048 new + 2 chunks of 64", [(0, 2048)] * 4 + [(1000, 64)] * 2),
    ]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for label, reqs in shapes:
            bsz, longest = len(reqs), max(p + n for p, n in reqs)
            args = list(extend_setup(bsz, longest - 1, 1, kv_dtype))  # pool and table only
            prefix = [p for p, _ in reqs]
            ext = [n for _, n in reqs]
            tokens = sum(ext)
            dev = DEV
            q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device=dev)
            k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=dev)
            lens = torch.tensor(ext, device=dev)
            args[:3] = [q, k, torch.randn_like(k)]
            args[7:13] = [torch.tensor(prefix, device=dev), lens, torch.cumsum(lens, 0) - lens,
                          torch.empty_like(q), 128**-0.5, max(ext)]  # fmt: skip
            block_t = extend_block_tokens(torch.bfloat16, kv_dtype, 128, 4)
            work = torch.tensor(extend_work(ext, prefix, block_t), dtype=torch.int32, device=dev)
            pairs = sum(n * p + n * (n + 1) // 2 for p, n in reqs)
            flops = 4 * 128 * 32 * pairs
            grid = time_ms(partial(extend_attention, *args))
            listed = time_ms(partial(extend_attention, *args, work=work.view(-1, 2)))
            pool = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
            print(f"  {label}, {pool}: grid {flops / grid / 1e9:6.1f}, work list "
                  f"{flops / listed / 1e9:6.1f} ({grid / listed:.2f}x)")  # fmt: skip
