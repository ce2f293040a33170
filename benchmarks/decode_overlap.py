"""Shared-prefix decode with the prefix kernel beside the members' own walks (two streams) vs
after each other, on an fp8 pool at the prefix-sharing run's shapes (64 groups x 16, prefix
2048, own keys 160 and 384), and the two kernels alone:

    python benchmarks/decode_overlap.py
"""

from __future__ import annotations

from functools import partial

import torch

from kernels import copy_gbps, decode_setup, share_prefixes, time_ms
from weft.kernels import SharedPrefix, decode_attention, decode_num_kv_splits
from weft.kernels.shared_prefix import shared_prefix_splits


def main() -> None:
    ceiling = copy_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s; fp8 pool, 32 q / 8 kv heads")
    groups, size, prefix = 64, 16, 2048
    bsz = groups * size
    for own in (160, 384):
        args = decode_setup(bsz, prefix + own)
        for name in ("k_buffer", "v_buffer"):
            args[name] = args[name].to(torch.float8_e4m3fn)
        blocks, starts = share_prefixes(args, groups, size, prefix)
        shared = SharedPrefix(**blocks, num_splits=decode_num_kv_splits(groups, 8, prefix, sms))
        splits = decode_num_kv_splits(bsz, 8, own, sms)
        width = splits + shared.num_splits
        partials = (
            torch.empty(bsz, 32, width, 128, dtype=torch.float32, device="cuda"),
            torch.empty(bsz, 32, width, dtype=torch.float32, device="cuda"),
        )
        run = partial(decode_attention, **args, num_kv_splits=splits, kv_starts=starts,
                      shared=shared, partials=partials)  # fmt: skip
        want = run().float().clone()
        rows = [f"after each other {time_ms(run) * 1e3:.1f} us"]
        prefix_only = partial(shared_prefix_splits, args["q"], args["k_buffer"], args["v_buffer"],
                              args["req_to_token"], shared, partials, args["scale"], splits,
                              128)  # fmt: skip
        rows.append(f"prefix kernel alone {time_ms(prefix_only) * 1e3:.1f} us")
        for label, side_prio, main_prio in (
            ("beside, equal priorities", 0, 0),
            ("beside, prefix stream high", -1, 0),
            ("beside, own walks high", 0, -1),
        ):
            side = torch.cuda.Stream(priority=side_prio)
            main_stream = torch.cuda.Stream(priority=main_prio)
            with torch.cuda.stream(main_stream):
                got = run(prefix_stream=side).float()
                err = ((got - want).norm() / want.norm()).item()
                assert err < 1e-3, (label, err)
                rows.append(f"{label} {time_ms(partial(run, prefix_stream=side)) * 1e3:.1f} us")
            torch.cuda.synchronize()
        print(f"  own {own} keys, {splits} own / {shared.num_splits} prefix splits: "
              + " | ".join(rows))  # fmt: skip


if __name__ == "__main__":
    main()
