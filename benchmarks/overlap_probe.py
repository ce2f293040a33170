"""Can a decode step's attention (memory-bound) run beside its projection GEMMs (compute-bound)
on one GPU? A nano-batch probe: the batch split in two halves A and B, A's attention on one
stream while B's GEMMs run on another, then the other way round (NanoFlow's idea), against the
runtime's order (the whole batch's attention, then its GEMMs) in CUDA graphs.

    python benchmarks/overlap_probe.py [--shapes 512x1536 1024x256] [--kv-dtypes fp8 bf16]
                                       [--carveouts 0 32 66] [--layers 8]

Per layer of Llama-3.1-8B (32 q / 8 kv heads, d 128, page 16; o_proj, gate_up, down, qkv of the
next layer; dummy bf16 weights, four distinct layers cycled so the L2 holds none): ms for the
attention alone, the GEMMs alone, both in the runtime's order, the halves one after the other
on one stream, and the halves overlapped on two streams. `lockstep` makes both streams wait for
each other at every phase boundary, so each attention meets a GEMM chain; `free` lets them
drift. A carveout c asks cuBLAS to use all SMs but c for the GEMMs it launches
(torch._C._set_sm_carveout_experimental), leaving c to the attention. GEMM-alone times under each
carveout show whether cuBLAS honoured it.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
from kernel_bench import copy_gbps, decode_bytes, decode_setup, graph_ms

HIDDEN, INTER, QKV = 4096, 14336, 6144


def make_layers(count: int) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02

    return [{"o": w(HIDDEN, HIDDEN), "gate_up": w(2 * INTER, HIDDEN), "down": w(HIDDEN, INTER),
             "qkv": w(QKV, HIDDEN)} for _ in range(count)]  # fmt: skip


class Half:
    """One nano-batch: its attention inputs (own pool) and its activations."""

    def __init__(self, bsz: int, kv_len: int, kv_dtype: torch.dtype) -> None:
        from weft.kernels.splits import decode_num_kv_splits

        self.bsz = bsz
        self.attn = decode_setup(bsz, kv_len)
        if kv_dtype != torch.bfloat16:
            self.attn["k_buffer"] = self.attn["k_buffer"].to(kv_dtype)
            self.attn["v_buffer"] = self.attn["v_buffer"].to(kv_dtype)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        fp8 = kv_dtype != torch.bfloat16
        self.splits = decode_num_kv_splits(bsz, 8, kv_len, sms, fp8=fp8)
        self.h = torch.randn(bsz, INTER, dtype=torch.bfloat16, device="cuda")

    def attention(self) -> None:
        from weft.kernels.decode import decode_attention

        decode_attention(**self.attn, num_kv_splits=self.splits)

    def gemms(self, layer: dict[str, torch.Tensor]) -> None:
        x = self.attn["out"].view(self.bsz, HIDDEN)
        y = F.linear(x, layer["o"])
        F.linear(y, layer["gate_up"])
        y = F.linear(self.h, layer["down"])
        F.linear(y, layer["qkv"])


def sequential(halves: list[Half], layers: list[dict[str, torch.Tensor]], n: int) -> None:
    for i in range(n):
        for half in halves:
            half.attention()
        for half in halves:
            half.gemms(layers[i % len(layers)])


def overlapped(a: Half, b: Half, layers: list[dict[str, torch.Tensor]], n: int, lockstep: bool,
               streams: tuple[torch.cuda.Stream, torch.cuda.Stream]) -> None:  # fmt: skip
    """2n phases: in even ones A attends while B runs GEMMs, in odd ones the other way round."""
    main = torch.cuda.current_stream()
    s1, s2 = streams
    s1.wait_stream(main)
    s2.wait_stream(main)
    for p in range(2 * n):
        layer = layers[(p // 2) % len(layers)]
        with torch.cuda.stream(s1):
            a.attention() if p % 2 == 0 else a.gemms(layer)
        with torch.cuda.stream(s2):
            b.gemms(layer) if p % 2 == 0 else b.attention()
        if lockstep:
            s1.wait_stream(s2)
            s2.wait_stream(s1)
    main.wait_stream(s1)
    main.wait_stream(s2)


def set_carveout(sms: int) -> bool:
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        return False
    setter(sms if sms > 0 else None)
    return True


def probe(bsz: int, kv_len: int, kv_dtype: torch.dtype, carveouts: list[int], n: int,
          ceiling: float) -> None:  # fmt: skip
    layers = make_layers(4)
    full = Half(bsz, kv_len, kv_dtype)
    a, b = Half(bsz // 2, kv_len, kv_dtype), Half(bsz // 2, kv_len, kv_dtype)
    kv_bytes = decode_bytes(bsz, kv_len, kv_bytes=1 if kv_dtype != torch.bfloat16 else 2)
    flops = 2 * bsz * HIDDEN * (HIDDEN + 2 * INTER + QKV) + 2 * bsz * INTER * HIDDEN
    name = "fp8" if kv_dtype != torch.bfloat16 else "bf16"
    print(f"\nB={bsz}, kv {kv_len}, {name} pool ({full.splits} split(s); halves "
          f"{a.splits}); ms per layer over {n} layers")  # fmt: skip
    attn = graph_ms([lambda: [full.attention() for _ in range(n)]]) / n
    print(f"  attention alone        {attn:7.3f}  ({kv_bytes / attn / 1e6 / ceiling:.0%} of copy)")
    halves_attn = graph_ms([lambda: [h.attention() for _ in range(n) for h in (a, b)]]) / n
    print(f"  attention, two halves  {halves_attn:7.3f}")
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for c in carveouts:
            if not set_carveout(c) and c:
                print("  (no torch._C._set_sm_carveout_experimental: carveouts skipped)")
                break
            gemm = graph_ms([lambda: [full.gemms(layers[i % 4]) for i in range(n)]]) / n
            half = graph_ms([lambda: [h.gemms(layers[i % 4]) for i in range(n) for h in (a, b)]])
            half /= n
            print(f"  {lib:<8} carveout {c:3}: GEMMs alone {gemm:7.3f} ({flops / gemm / 1e9:4.0f} "
                  f"TF/s), two halves {half:7.3f}")  # fmt: skip
        set_carveout(0)
    torch.backends.cuda.preferred_blas_library("cublas")
    seq = graph_ms([partial(sequential, [full], layers, n)]) / n
    seq_halves = graph_ms([partial(sequential, [a, b], layers, n)]) / n
    print(f"  runtime's order        {seq:7.3f}   halves one after the other {seq_halves:7.3f}")
    rows = []
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for c in carveouts:
            if not set_carveout(c) and c:
                break
            for prio in ("equal", "attention high", "gemms high"):
                hi, lo = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
                streams = {"equal": (lo, torch.cuda.Stream(priority=0)),
                           "attention high": (hi, lo), "gemms high": (lo, hi)}[prio]  # fmt: skip
                for lockstep in (True, False):
                    ms = graph_ms([partial(overlapped, a, b, layers, n, lockstep, streams)]) / n
                    rows.append((ms, lib, c, prio, "lockstep" if lockstep else "free"))
        set_carveout(0)
    torch.backends.cuda.preferred_blas_library("cublas")
    for ms, lib, c, prio, mode in sorted(rows):
        print(f"  overlapped {lib:<8} carveout {c:3} {prio:<14} {mode:<8} {ms:7.3f}  "
              f"({ms / seq:.3f} of the runtime's order)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["512x1536", "1024x256"])
    parser.add_argument("--kv-dtypes", nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--carveouts", nargs="+", type=int, default=[0, 32, 66])
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s, torch {torch.__version__}")
    dtypes = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    for shape in args.shapes:
        bsz, kv_len = (int(v) for v in shape.split("x"))
        for kv in args.kv_dtypes:
            probe(bsz, kv_len, dtypes[kv], args.carveouts, args.layers, ceiling)
            torch.cuda.empty_cache()  # the probe's tensors are gone with its frame


if __name__ == "__main__":
    main()
