"""`kernel.py elementwise`: RMSNorm, SiLU-and-mul, rotary, the KV store and the grammar bitmask
against the copy ceiling (and torch eager where it has the same op), and the greedy argmax
against torch.argmax."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from kernel_util import DEV, graph_ms, share, time_ms

BF16 = torch.bfloat16


def rmsnorm_case() -> tuple[Callable[[], object], Callable[[], object], int]:
    """(weft's rmsnorm, torch eager's same math, bytes moved) at T=4096, hidden 4096, bf16."""
    from weft.kernels.norm import rmsnorm

    x = torch.randn(4096, 4096, dtype=BF16, device=DEV)
    w, out = torch.randn(4096, dtype=BF16, device=DEV), torch.empty_like(x)

    def eager() -> torch.Tensor:
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    return lambda: rmsnorm(x, w, 1e-5, out=out), eager, 2 * x.numel() * 2


def bench_elementwise(ceiling: float) -> None:
    from weft.kernels.activation import silu_and_mul
    from weft.kernels.bitmask import apply_token_bitmask
    from weft.kernels.kv_store import store_kv
    from weft.kernels.norm import fused_add_rmsnorm
    from weft.kernels.rotary import cos_sin_cache, rotary_embedding

    t, hidden, inter = 4096, 4096, 14336
    x = torch.randn(t, hidden, dtype=BF16, device=DEV)
    res, w = torch.randn_like(x), torch.randn(hidden, dtype=BF16, device=DEV)
    gate_up = torch.randn(t, 2 * inter, dtype=BF16, device=DEV)
    q = torch.randn(t, 32, 128, dtype=BF16, device=DEV)
    k = torch.randn(t, 8, 128, dtype=BF16, device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=DEV).float() / 128))
    cache, pos = cos_sin_cache(inv_freq, 8192), torch.randint(0, 8192, (t,), device=DEV)
    kb, vb = (torch.empty(65536, 8, 128, dtype=BF16, device=DEV) for _ in range(2))
    loc = torch.randperm(65536, device=DEV)[:t]
    logits = torch.randn(64, 128256, device=DEV)
    mask = torch.randint(-(2**31), 2**31 - 1, (64, 4008), dtype=torch.int32, device=DEV)

    def eager_silu() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    norm, eager_norm, norm_bytes = rmsnorm_case()
    n = t * hidden * 2
    rows = [
        ("rmsnorm T=4096 hidden 4096", norm, norm_bytes),
        ("  torch eager (the same math)", eager_norm, norm_bytes),
        ("fused_add_rmsnorm T=4096 hidden 4096", lambda: fused_add_rmsnorm(x, res, w, 1e-5), 4 * n),
        ("silu_and_mul T=4096 I=14336", lambda: silu_and_mul(gate_up), 3 * t * inter * 2),
        ("  torch eager (F.silu(gate) * up)", eager_silu, 3 * t * inter * 2),
        ("rotary T=4096 32+8 heads d=128", lambda: rotary_embedding(pos, q, k, cache), 2 * t * 40 * 256 + t * 512),
        ("store_kv T=4096 8 kv heads d=128", lambda: store_kv(k, k, kb, vb, loc), 4 * t * 8 * 256),
        ("bitmask 64 x 128256 fp32", lambda: apply_token_bitmask(logits, mask), 64 * 4008 * 4 + 64 * 64128 * 4),
    ]  # fmt: skip
    print(f"\n{'elementwise (bf16), eager, L2 flushed':<40} {'time, GB/s, share of copy':>30}")
    for name, fn, nbytes in rows:
        print(f"{name:<40} {share(nbytes, time_ms(fn), ceiling)}")
    bench_argmax()


def bench_argmax(batches: tuple[int, ...] = (1, 64, 512)) -> None:
    """argmax_rows against torch.argmax over Llama-3's 128,256-id vocabulary, 20 calls in a CUDA
    graph (as a decode step's sampling runs): us per call."""
    from weft.kernels.argmax import argmax_rows

    print("\ngreedy argmax over 128,256 logits in a CUDA graph: argmax_rows | torch.argmax")
    for dtype in (BF16, torch.float32):
        for bsz in batches:
            x = (4 * torch.randn(bsz, 128256, device=DEV)).to(dtype)
            assert torch.equal(argmax_rows(x), x.argmax(-1))
            ours = graph_ms([partial(argmax_rows, x)] * 20)
            theirs = graph_ms([partial(torch.argmax, x, -1)] * 20)
            print(f"  B={bsz:<4} {str(dtype).removeprefix('torch.'):<9} {ours * 1e3:6.1f} us | "
                  f"{theirs * 1e3:6.1f} us ({theirs / ours:.2f}x)")  # fmt: skip
