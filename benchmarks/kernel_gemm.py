"""`kernel.py gemv` and `kernel.py blas`: Llama-3.1-8B's projections as a decode step meets them,
inside a CUDA graph, back to back over distinct (cold) weights: weft's skinny GEMV (its launch
candidates, and a one-row decode layer without attention) against cuBLAS; cuBLAS as torch picks
it against cuBLASLt per token count.

Per shape and row count: microseconds per projection (the graph's time / layers) and the share of
the copy ceiling over the weight's bytes; every GEMV launch's output is checked against a float32
reference first. cuBLAS's down projection runs after silu_and_mul's own launch, as the model
calls it; the GEMV's has SiLU-and-mul folded in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from weft.kernels.activation import silu_and_mul
from weft.kernels.norm import fused_add_rmsnorm
from weft.kernels.reference import gemv_ref
from weft.kernels.skinny import GemvLaunch, gemv
from weft.runtime.executor.graph_tuning import CANDIDATES, replay_us

DEV = "cuda"

# (name, out features, in features, silu_mul): Llama-3.1-8B's projections
SHAPES = (
    ("qkv", 6144, 4096, False),
    ("o_proj", 4096, 4096, False),
    ("gate_up", 28672, 4096, False),
    ("down", 4096, 14336, True),
    ("lm_head", 128256, 4096, False),  # 1 GB: fewer copies (see --layers)
)
# (block_n, block_k, split_k, num_warps, num_stages): the runtime's candidates first
# (graph_tuning.CANDIDATES, what its capture times), then more around them
LAUNCHES = [GemvLaunch(*c) for c in (*CANDIDATES, *(c for c in (
    (64, 128, 4, 4, 4), (64, 128, 8, 4, 4), (64, 128, 1, 4, 3), (64, 128, 4, 4, 6),
    (64, 256, 1, 4, 3), (64, 64, 4, 4, 8), (128, 128, 1, 4, 4), (128, 128, 2, 4, 4),
    (32, 128, 1, 4, 4), (32, 128, 2, 4, 4), (128, 64, 4, 4, 6),
) if c not in CANDIDATES))]  # fmt: skip


def graph_us(op: Callable[[Any], object], weights: Sequence[Any], reps: int) -> float:
    """Microseconds per op of one CUDA graph replay running op over every weight in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:  # compile and warm up outside the capture
            op(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            op(w)
    for _ in range(2):
        graph.replay()
    return replay_us(graph, reps) / len(weights)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _layer_of(layer: Callable[..., None], gemv_on: frozenset[str], pdl: bool, w: Any) -> None:
    layer(w, gemv_on, pdl)


def _name(launch: GemvLaunch) -> str:
    return (f"n {launch.block_n:3} k {launch.block_k:4} split {launch.split_k} "
            f"warps {launch.num_warps} stages {launch.num_stages}")  # fmt: skip


# per shape, the launch for the layer chain (the fastest per shape on the H200)
LAYER_LAUNCHES = {
    "qkv": GemvLaunch(64, 64, 1, 4, 8),
    "o_proj": GemvLaunch(64, 128, 2, 4, 4),
    "gate_up": GemvLaunch(64, 128, 1, 4, 4),
    "down": GemvLaunch(128, 128, 4, 8, 4),
}


def bench_layers(layers: int, ceiling: float, reps: int) -> None:
    """A decode layer at one row without its attention: add + RMSNorm, qkv, o_proj (on q's
    columns), add + RMSNorm, gate_up, down; per layer, on distinct weights, in one graph."""
    dims = {name: (n, k) for name, n, k, _ in SHAPES}
    ws = [{name: torch.randn(*dims[name], dtype=torch.bfloat16, device=DEV) / dims[name][1] ** 0.5
           for name in LAYER_LAUNCHES} for _ in range(layers)]  # fmt: skip
    norm_w = torch.ones(4096, dtype=torch.bfloat16, device=DEV)
    h = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEV)
    res = torch.randn(1, 4096, dtype=torch.bfloat16, device=DEV)
    layer_bytes = sum(n * k * 2 for n, k in dims.values() if (n, k) != dims["lm_head"])
    copy_us = layer_bytes / ceiling / 1e3  # ceiling: GB/s

    def layer(w: dict[str, torch.Tensor], gemv_on: frozenset[str], pdl: bool) -> None:
        def proj(name: str, x: torch.Tensor) -> torch.Tensor:
            if name in gemv_on:
                return gemv(x, w[name], silu_mul=name == "down", launch=LAYER_LAUNCHES[name],
                            pdl=pdl)  # fmt: skip
            return F.linear(silu_and_mul(x) if name == "down" else x, w[name])

        x = h.clone()
        fused_add_rmsnorm(x, res, norm_w, 1e-5, pdl=pdl)
        qkv = proj("qkv", x)
        o = proj("o_proj", qkv[:, :4096])
        fused_add_rmsnorm(o, res, norm_w, 1e-5, pdl=pdl)
        proj("down", proj("gate_up", o))

    print(f"\nlayer chain, 1 row, {layers} layers: copy speed {copy_us:.1f} us per layer")
    every = frozenset(LAYER_LAUNCHES)
    qkv_o = frozenset({"qkv", "o_proj"})
    variants = [  # (label, projections on the GEMV, programmatic dependent launches)
        ("cuBLAS", frozenset(), False),
        ("cuBLAS, norms as programmatic dependents", frozenset(), True),
        ("GEMV everywhere", every, False),
        ("GEMV everywhere, PDL", every, True),
        ("GEMV qkv + o_proj", qkv_o, False),
        ("GEMV qkv + o_proj, PDL", qkv_o, True),
    ]
    for label, gemv_on, pdl in variants:
        us = graph_us(partial(_layer_of, layer, gemv_on, pdl), ws, reps)
        print(f"  {us:7.1f} us per layer ({copy_us / us:4.0%} of copy speed)  {label}")
    del ws
    torch.cuda.empty_cache()


def bench_shape(name: str, n: int, k: int, silu: bool, rows_list: list[int], layers: int,
                launches: list[GemvLaunch], ceiling: float, reps: int) -> None:  # fmt: skip
    layers = max(2, min(layers, (4 << 30) // (n * k * 2)))  # at most ~4 GB of weights
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=DEV) / k**0.5
               for _ in range(layers)]  # fmt: skip
    nbytes = n * k * 2
    copy_us = nbytes / ceiling / 1e3

    def cell(us: float) -> str:
        return f"{us:7.1f} us {copy_us / us:5.0%}"

    print(f"\n{name} [{n} x {k}]: copy speed {copy_us:.1f} us")
    for rows in rows_list:
        x = torch.randn(rows, 2 * k if silu else k, dtype=torch.bfloat16, device=DEV)
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=DEV)
        want = gemv_ref(x, weights[0], None, silu)
        cublas = graph_us(partial(_linear, silu_and_mul(x) if silu else x), weights, reps)
        line = f"  rows {rows}: cuBLAS {cell(cublas)}"
        if silu:
            plain = torch.randn(rows, k, dtype=torch.bfloat16, device=DEV)
            alone = graph_us(partial(_linear, plain), weights, reps)
            line += f" (linear alone {cell(alone)})"
        print(line)
        timed = []
        for launch in launches:
            try:
                got = gemv(x, weights[0], silu_mul=silu, out=out, launch=launch).float()
            except OutOfResources:
                print(f"    {launch}: out of shared memory")
                continue
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{name} rows {rows} {launch}: relative error {err:.3g}"

            def run(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out,
                    launch: GemvLaunch = launch) -> torch.Tensor:  # fmt: skip
                return gemv(x, w, silu_mul=silu, out=out, launch=launch)

            us = graph_us(run, weights, reps)
            timed.append((us, launch))
        timed.sort(key=lambda t: t[0])
        for _us, launch in timed[:3]:  # the best three again, as programmatic dependents

            def run_pdl(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out,
                        launch: GemvLaunch = launch) -> torch.Tensor:  # fmt: skip
                return gemv(x, w, silu_mul=silu, out=out, launch=launch, pdl=True)

            print(f"    {cell(graph_us(run_pdl, weights, reps))}  {_name(launch)} PDL")
        for us, launch in timed:
            print(f"    {cell(us)}  {_name(launch)}")
    del weights
    torch.cuda.empty_cache()


def bench_blas(ceiling: float, batches: list[int]) -> None:
    """cuBLAS as torch picks it against cuBLASLt preferred, per projection and token count, in a
    CUDA graph over 8 weights: what the graph runner's capture chooses between per batch size."""
    print("\nprojection GEMMs in a CUDA graph: us per call (cublas | cublaslt), TFLOP/s, % of copy")
    for name, n, k, _ in SHAPES[:4]:
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * 0.02 for _ in range(8)]
        for m in batches:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
            cells = []
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_us(partial(_linear, x), ws, 10)
                cells.append(f"{us:8.1f} ({2 * m * n * k / us / 1e6:5.0f} TF, "
                             f"{n * k * 2 / us / 1e3 / ceiling:4.0%})")  # fmt: skip
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"  {name:<8} M={m:<5} " + " | ".join(cells))
        del ws
        torch.cuda.empty_cache()


##### `kernel.py gguf`: the dequantizing matmul of GGUF blocks (kernels/gguf_gemv.py) #####

# (name, out features, in features): Qwen2.5-Coder-1.5B's projections (its Q4_K_M file: Q4_K,
# with Q6_K for v, half the down projections and the lm_head)
GGUF_SHAPES = (
    ("q", 1536, 1536), ("o_proj", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960),
    ("lm_head", 151936, 1536),
)  # fmt: skip
GGUF_LAUNCHES = [(bn, 0, w, lb) for bn in (16, 32, 64) for w in (2, 4, 8) for lb in (4,)]


def bench_gguf(ceiling: float, types: list[str], rows_list: list[int], layers: int, reps: int,
               sweep: bool) -> None:  # fmt: skip
    """Per type, shape and row count: the default launch (or with `sweep` every GGUF_LAUNCHES
    one) in a CUDA graph over `layers` distinct block matrices, against the copy ceiling over the
    blocks' bytes and against cuBLAS on the same weight in bf16 (4x the bytes); the output is
    checked against the torch dequantizer's weight first."""
    from weft.kernels import gguf as kgguf
    from weft.kernels.gguf_gemv import MAX_ROWS, GGUFLaunch, matmul

    ids = {t.name: t.ggml_id for t in kgguf.TYPES.values()}
    for tname in types:
        ggml_id = ids[tname]
        for name, n, k in GGUF_SHAPES:
            t = kgguf.block_type(ggml_id)
            nbytes = n * t.row_bytes(k)
            count = max(2, min(layers, (2 << 30) // (n * k * 2)))
            gen = torch.Generator(device=DEV).manual_seed(0)
            blocks = [kgguf.random_blocks(ggml_id, n, k, gen, DEV) for _ in range(count)]
            dense = kgguf.dequantize(blocks[0], ggml_id, k).to(torch.bfloat16)
            copy_us = nbytes / ceiling / 1e3
            print(f"\n{tname} {name} [{n} x {k}]: {nbytes / 2**20:.1f} MiB of blocks, copy "
                  f"speed {copy_us:.1f} us (bf16: {2 * copy_us * n * k / nbytes:.1f} us)")  # fmt: skip
            for rows in [r for r in rows_list if r <= MAX_ROWS]:
                x = torch.randn(rows, k, dtype=torch.bfloat16, device=DEV)
                want = x.float() @ dense.float().T
                bf16 = [dense] + [torch.empty_like(dense) for _ in range(count - 1)]
                cublas = graph_us(partial(_linear, x), bf16, reps)
                line = f"  rows {rows}: cuBLAS bf16 {cublas:7.1f} us"
                launches = [GGUFLaunch(*c) for c in GGUF_LAUNCHES] if sweep else [GGUFLaunch()]
                timed = []
                for launch in launches:
                    got = matmul(x, blocks[0], ggml_id, launch=launch).float()
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 1e-2, f"{tname} {name} rows {rows} {launch}: error {err:.3g}"

                    def run(b: torch.Tensor, x: torch.Tensor = x, launch: GGUFLaunch = launch,
                            ggml_id: int = ggml_id) -> torch.Tensor:  # fmt: skip
                        return matmul(x, b, ggml_id, launch=launch)

                    timed.append((graph_us(run, blocks, reps), launch))
                timed.sort(key=lambda p: p[0])
                us, best = timed[0]
                print(f"{line} | gguf {us:7.1f} us {copy_us / us:5.0%} of copy, "
                      f"{cublas / us:4.2f}x cuBLAS bf16  ({best})")  # fmt: skip
                for us, launch in timed[1:] if sweep else []:
                    print(f"      {us:7.1f} us {copy_us / us:5.0%}  {launch}")
            del blocks, dense
            torch.cuda.empty_cache()
