"""The CPU's dense projections: F.linear (x @ W^T) against weft's host_linear ((W @ x^T)^T where
faster) at a model config's projection shapes, float32, by rows of x (a decode batch, a
speculative verify step's k + 1 tokens, a prefill chunk).

    python benchmarks/kernel_host.py --model benchmarks/configs/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_utils import device_name, markdown_table

from weft.kernels.host_linear import host_linear


def shapes(config: Path) -> dict[str, tuple[int, int]]:
    """(out, in) of the projections of one decoder layer and the LM head."""
    c = json.loads((config / "config.json").read_text())
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = (
        c["num_attention_heads"] * hd,
        c.get("num_key_value_heads", c["num_attention_heads"]) * hd,
    )
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter),
            "lm_head": (c["vocab_size"], h)}  # fmt: skip


def ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `reps` calls after two."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", type=Path, default=Path("benchmarks/configs/qwen2.5-coder-1.5b"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{device_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    out = []
    for name, (n, k) in shapes(args.model).items():
        w = torch.randn(n, k) * 0.02
        for m in args.rows:
            x = torch.randn(m, k)
            a = ms(lambda: F.linear(x, w), args.reps)  # noqa: B023
            b = ms(lambda: host_linear(x, w), args.reps)  # noqa: B023
            out.append([name, f"{n}x{k}", str(m), a, b, a / b])
    print(
        markdown_table(["projection", "W", "rows", "F.linear ms", "host_linear ms", "speedup"], out)
    )


if __name__ == "__main__":
    main()
