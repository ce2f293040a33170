"""Grid order of the attention kernels: kv heads (q heads for extend) as the fastest grid axis vs
requests fastest, at the runtime's launches (`python benchmarks/kernels.py --grid-order`, CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from kernels_extend import extend_setup

from kernels import decode_bytes, decode_setup, share_prefixes, time_ms


def both_orders(fn: Callable[[], object]) -> tuple[float, float]:
    """fn's median ms with requests fastest, then with heads fastest (decode, prefix, extend)."""
    import weft.kernels.decode as decode
    import weft.kernels.extend as extend

    times = []
    for heads_first in (False, True):
        decode.GRID_HEADS_FIRST = extend.GRID_HEADS_FIRST = heads_first
        times.append(time_ms(fn))
    decode.GRID_HEADS_FIRST = extend.GRID_HEADS_FIRST = True
    return times[0], times[1]


def row(label: str, old: float, new: float, roofline_ms: float | None = None) -> None:
    line = f"  {label}: requests first {old * 1e3:8.1f} us, heads first {new * 1e3:8.1f} us"
    line += f" ({old / new:.2f}x)"
    if roofline_ms is not None:
        line += f"; roofline {roofline_ms * 1e3:.1f} us (now {roofline_ms / new:.0%})"
    print(line)


def bench_grid_order(ceiling: float) -> None:
    from weft.kernels import SharedPrefix, decode_attention, decode_num_kv_splits, extend_attention
    from weft.runtime.shared_prefix import prefix_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"\ngrid order, 32 q / 8 kv heads, d=128, page 16 on shuffled pages (copy {ceiling:.0f})")
    for bsz, kv_len, fp8 in ((64, 2048, False), (512, 1536, True), (1, 2048, False)):
        args = decode_setup(bsz, kv_len)
        if fp8:
            args["k_buffer"] = args["k_buffer"].to(torch.float8_e4m3fn)
            args["v_buffer"] = args["v_buffer"].to(torch.float8_e4m3fn)
        splits = decode_num_kv_splits(bsz, 8, kv_len, sms)
        old, new = both_orders(partial(decode_attention, **args, num_kv_splits=splits))
        ideal = decode_bytes(bsz, kv_len, kv_bytes=1 if fp8 else 2) / (ceiling * 1e6)
        row(f"decode B={bsz}, kv {kv_len}, {'fp8' if fp8 else 'bf16'}", old, new, ideal)
    groups, size, prefix = 64, 16, 2048
    bsz = groups * size
    for own in (160, 384):
        args = decode_setup(bsz, prefix + own)
        args["k_buffer"] = args["k_buffer"].to(torch.float8_e4m3fn)
        args["v_buffer"] = args["v_buffer"].to(torch.float8_e4m3fn)
        blocks, starts = share_prefixes(args, groups, size, prefix)
        shared = SharedPrefix(**blocks, num_splits=prefix_splits(prefix, groups, 8))
        splits = decode_num_kv_splits(bsz, 8, own, sms)
        run = partial(decode_attention, **args, num_kv_splits=splits, kv_starts=starts,
                      shared=shared)  # fmt: skip
        ideal = (groups * prefix + bsz * own) * 8 * 128 * 2 / (ceiling * 1e6)
        row(f"prefix sharing {groups} x {size}, 2048 + {own}, fp8", *both_orders(run), ideal)
    for bsz, pre, ext, kv_dtype, share in (
        (8, 0, 2048, torch.bfloat16, 1),
        (64, 2048, 128, torch.float8_e4m3fn, 1),
        (64, 2048, 128, torch.float8_e4m3fn, 16),
    ):
        eargs = extend_setup(bsz, pre, ext, kv_dtype, share)
        flops = 4 * 128 * 32 * bsz * (ext * pre + ext * (ext + 1) // 2)
        old, new = both_orders(partial(extend_attention, *eargs))
        pool = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
        print(f"  extend {bsz} x ({pre} cached, shared by {share}, + {ext}), {pool}: requests "
              f"first {flops / old / 1e9:.1f}, heads first {flops / new / 1e9:.1f} TFLOP/s "
              f"({old / new:.2f}x)")  # fmt: skip
