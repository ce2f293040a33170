"""`kernel.py decode`: the paged decode kernel on a bf16 or fp8 (e4m3) pool against the copy
ceiling, next to FlashInfer's decode; its split counts and launches swept; and a sliding window
against the whole context (`python benchmarks/kernel_decode.py --window 512 1024`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kernel_util
import torch
from kernel_util import (
    DEV,
    decode_bytes,
    decode_call,
    decode_setup,
    decode_splits,
    flashinfer_decode_ms,
    graph_ms,
    num_sms,
    random_pool,
    share,
    sweep_launches,
    time_ms,
)

FP8 = torch.float8_e4m3fn


def pool(fp8: bool) -> tuple[torch.dtype, int, str]:
    """(KV dtype, bytes per element, name)."""
    return (FP8, 1, "fp8 e4m3") if fp8 else (torch.bfloat16, 2, "bf16")


def bench_decode(ceiling: float, fp8: bool, batches: list[int], kv_len: int) -> None:
    """The runtime's launch per batch (eager, L2 flushed) and FlashInfer's tensor-core decode on
    the same pool; over fp8 also V's conversion sunk into the dot operand instead of staged (the
    default), its output checked against the staged one."""
    dtype, kv_bytes, name = pool(fp8)
    print(f"\ndecode attention, {name} pool, kv {kv_len}, {kernel_util.HEADS} q / "
          f"{kernel_util.KV_HEADS} kv heads, d=128, page 16: "
          "the runtime's launch | FlashInfer 0.5.3 (tensor cores)")  # fmt: skip
    for bsz in batches:
        args = decode_setup(bsz, kv_len, dtype)
        nbytes, splits = decode_bytes(bsz, kv_len, kv_bytes), decode_splits(bsz, kv_len, fp8)
        cells = [share(nbytes, time_ms(decode_call(args, splits)), ceiling)]
        if fp8:
            staged = decode_call(args, splits)().float().clone()
            sunk = decode_call(args, splits, fp8_v_staged=False)
            diff = (sunk().float() - staged).abs().max().item()
            cells.append(f"V sunk {share(nbytes, time_ms(sunk), ceiling)} (max |diff| {diff:.1e})")
        fi = flashinfer_decode_ms(args, bsz, kv_len)
        cells.append("FlashInfer " + (share(nbytes, fi, ceiling) if fi else "not installed"))
        print(f"  B={bsz:<4} {splits:>2} splits: " + " | ".join(cells))


def bench_splits(ceiling: float, fp8: bool, batches: list[int], kv_len: int) -> None:
    """The runtime's launch per split count inside a CUDA graph, over pools of >= 256 MB per graph
    (one per layer, so the L2 holds none of them, as between a model's layers): the table the
    split-count model (kernels/splits.py) is fitted to. * = the model's pick."""
    dtype, kv_bytes, name = pool(fp8)
    grid = (1, 2, 4, 8, 16, 32, 64)
    print(f"\ndecode attention in a CUDA graph, {name} pool, kv {kv_len}, {kernel_util.HEADS} q / "
          f"{kernel_util.KV_HEADS} kv heads: us and % of copy per "
          f"split count {grid}; * = the runtime's pick")  # fmt: skip
    for bsz in batches:
        nbytes = decode_bytes(bsz, kv_len, kv_bytes)
        sets = [decode_setup(bsz, kv_len, dtype)
                for _ in range(max(2, min(32, (256 << 20) // nbytes)))]  # fmt: skip
        pick = decode_splits(bsz, kv_len, fp8)
        cells = []
        for splits in grid:
            if splits * 64 > kv_len:
                break
            ms = graph_ms([decode_call(a, splits) for a in sets])
            mark = "*" if splits == pick else " "
            cells.append(f"{ms * 1e3:6.1f} {nbytes / ms / 1e6 / ceiling:4.0%}{mark}")
        print(f"  B={bsz:<4} " + " | ".join(cells))
        del sets
        torch.cuda.empty_cache()


def bench_launches(ceiling: float, fp8: bool, batches: list[int], kv_len: int) -> None:
    """Keys per tile, warps and pipeline stages around the runtime's launch, at its split count
    and twice that (small batches: also 16 and 32), inside a CUDA graph: the best three per batch
    against the runtime's launch."""
    dtype, kv_bytes, name = pool(fp8)
    print(f"\ndecode launches in a CUDA graph, {name} pool, kv {kv_len}: % of copy")
    for bsz in batches:
        args = decode_setup(bsz, kv_len, dtype)
        nbytes, pick = decode_bytes(bsz, kv_len, kv_bytes), decode_splits(bsz, kv_len, fp8)
        splits = {pick, 2 * pick, 16, 32} if bsz <= 8 else {pick, 2 * pick}
        grid = [(s, bn, w, st) for s in sorted(splits) for bn in (32, 64, 128) for w in (2, 4, 8)
                for st in (2, 3, 4)]  # fmt: skip
        results = sweep_launches(args, grid, timer=lambda fn: graph_ms([fn]))
        default = graph_ms([decode_call(args, pick)])
        best = ", ".join(f"{nbytes / ms / 1e6 / ceiling:.0%} ({s} splits, {bn} keys, {w} warps, "
                         f"{st} stages)" for ms, s, bn, w, st in results[:3])  # fmt: skip
        print(f"  B={bsz:<4} runtime {share(nbytes, default, ceiling)} | best: {best}")


##### Sliding windows #####

# (name, q heads, kv heads, head dim): Gemma 3 270M's attention, and Llama-3.1-8B's
WINDOW_SHAPES = [("gemma3-270m", 4, 1, 256), ("llama3.1-8b", 32, 8, 128)]


def window_setup(bsz: int, kv_len: int, heads: int, kv_heads: int, dim: int,
                 kv_dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    """decode_attention's tensors (decode_setup's keys) at another attention shape."""
    k_buffer, v_buffer, table, rows = random_pool([kv_len] * bsz, 16, kv_heads, dim,
                                                  torch.bfloat16)  # fmt: skip
    return {
        "q": torch.randn(bsz, heads, dim, dtype=torch.bfloat16, device=DEV),
        "k_buffer": k_buffer.to(kv_dtype),
        "v_buffer": v_buffer.to(kv_dtype),
        "req_to_token": table,
        "req_rows": rows,
        "seq_lens": torch.full((bsz,), kv_len, dtype=torch.int64, device=DEV),
        "out": torch.empty(bsz, heads, dim, dtype=torch.bfloat16, device=DEV),
        "scale": dim**-0.5,
    }


def bench_window(
    ceiling: float, fp8: bool, batches: list[int], kv_len: int, windows: list[int]
) -> None:
    """Decode at kv_len with each window against the whole context, inside a CUDA graph, at the
    runtime's split counts (the window's: fitted to min(window, kv_len)). GB/s counts the keys
    each launch must read: the window's."""
    from weft.kernels.splits import decode_num_kv_splits

    dtype, kv_bytes, name = pool(fp8)
    for shape, heads, kv_heads, dim in WINDOW_SHAPES:
        print(f"\ndecode attention in a CUDA graph, {name} pool, kv {kv_len}, {shape} ({heads} q / "
              f"{kv_heads} kv heads, d={dim}), page 16: whole context | each window")  # fmt: skip
        for bsz in batches:
            args = window_setup(bsz, kv_len, heads, kv_heads, dim, dtype)
            cells = []
            for window in [None, *windows]:
                keys = kv_len if window is None else min(window, kv_len)
                splits = decode_num_kv_splits(bsz, kv_heads, keys, num_sms(), fp8=fp8)
                kv = 2 * bsz * keys * kv_heads * dim * kv_bytes
                nbytes = kv + bsz * keys * 8 + 2 * bsz * heads * dim * 2
                ms = graph_ms([decode_call(args, splits, window=window)])
                label = "all" if window is None else f"w {window}"
                cells.append(f"{label} ({splits} splits) {share(nbytes, ms, ceiling)}")
            print(f"  B={bsz:<4} " + " | ".join(cells))
            del args
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """The window benchmark on its own (kernel.py's other decode benchmarks take no window)."""
    from bench_utils import device_name, local_copy_bandwidth

    ap = argparse.ArgumentParser(description="decode with a sliding window vs the whole context")
    ap.add_argument("--window", type=int, nargs="+", default=[512, 1024], help="window sizes")
    ap.add_argument("--kv-len", type=int, default=8192, help="tokens per request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--fp8", action="store_true", help="an fp8 (e4m3) pool")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_decode.py needs CUDA", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    ceiling = local_copy_bandwidth() / 1e9
    print(f"{device_name()}, torch {torch.__version__}")
    print(f"device-to-device copy: {ceiling:,.0f} GB/s (read + write)", flush=True)
    bench_window(ceiling, args.fp8, args.batches, args.kv_len, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
