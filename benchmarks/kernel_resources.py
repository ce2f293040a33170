"""Registers, spills, shared memory and tensor-core instructions of the attention kernels' launches
and the skinny GEMV's (plain and with the RMSNorms folded in),
compiled for sm_90 on any machine (Triton's own ptxas; no GPU needed):

    python benchmarks/kernel_resources.py

Each row is a launch the runtime makes (its constexprs and num_warps / num_stages) or one a tuning
sweep tried. A non-zero spill stack or 255 registers marks a launch that is short of registers;
`wgmma` counts Hopper's warpgroup MMA instructions, `mma.sync` the older per-warp ones. Triton
versions differ: this machine's Triton may not be the device's, so read the rows as leads.

NOTE: a launch specializes its arguments: pointers (all 16-byte aligned in the runtime) and
integers divisible by 16 (the strides: heads x 128, the token table's row) carry
`tt.divisibility` 16. Without it loads are not vectorized and the pipeliner makes no cp.async
(no loads in flight across iterations), so the rows here set it as the runtime's launches do.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weft.kernels.decode import _decode_split_kernel
from weft.kernels.extend import _extend_kernel
from weft.kernels.shared_prefix import _prefix_split_kernel
from weft.kernels.skinny import _gemv_kernel

FP8, BF16 = "*fp8e4nv", "*bf16"


def compile_sm90(fn: Any, pointers: dict[str, str], const: dict[str, Any], warps: int,
                 stages: int) -> Any:  # fmt: skip
    """`fn` compiled for sm_90 as a runtime launch specializes it (see the NOTE above)."""
    names = fn.arg_names
    # capitalised arguments are pointers (int32 indices unless given), the others int32
    sig = {n: pointers.get(n, "*i32" if n[0].isupper() else "i32") for n in names}
    sig.update(dict.fromkeys(const, "constexpr"))
    if "qk_scale" in sig:
        sig["qk_scale"] = "fp32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in const and (n[0].isupper() or n.startswith("stride_"))}  # fmt: skip
    constexprs = {(names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=aligned)
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(fn: Any, pointers: dict[str, str], const: dict[str, Any], warps: int,
              stages: int) -> str:  # fmt: skip
    """One compile: 'regs R, stack S B, shared M KB, wgmma W, mma.sync N'."""
    kernel = compile_sm90(fn, pointers, const, warps, stages)
    ptx = kernel.asm["ptx"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return (
        f"regs {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'} B, "
        f"shared {kernel.metadata.shared / 1024:.0f} KB, wgmma {ptx.count('wgmma.mma_async')}, "
        f"mma.sync {ptx.count('mma.sync')}, cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}"
    )


def main() -> None:
    print(f"triton {triton.__version__}, sm_90; Llama-3.1-8B heads (32 q / 8 kv, d 128), bf16 q")
    common = {"G": 4, "D": 128, "BLOCK_D": 128, "DOT_PRECISION": "tf32"}
    fp8 = {"FP16_DOTS": True, "V_STAGED": True}
    bf16 = {"FP16_DOTS": False, "V_STAGED": False}
    prefix_ptrs = {"Q": BF16, "K_buf": FP8, "V_buf": FP8, "Part_o": "*fp32", "Part_lse": "*fp32",
                   "Req_to_token": "*i64"}  # fmt: skip
    decode_ptrs = {**prefix_ptrs, "Out": BF16}
    extend_ptrs = {"Q": BF16, "K": BF16, "V": BF16, "K_buf": FP8, "V_buf": FP8, "Out": BF16,
                   "Req_to_token": "*i64"}  # fmt: skip
    rows: list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]] = []
    for n, w, s in ((128, 4, 2), (128, 8, 2), (64, 4, 3), (32, 4, 2)):
        rows.append((f"prefix kernel, fp8, 64 rows, {n} keys", _prefix_split_kernel, prefix_ptrs,
                     {**common, **fp8, "BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_N": n}, w, s))  # fmt: skip
    split = {
        **common,
        "BLOCK_H": 16,
        "PREFIX_BLOCK_N": 128,
        "HAS_KV_STARTS": False,
        "DIRECT": False,
        "SUM_HERE": False,
        "BLOCK_S": 32,
        "ROPE": False,
        "SATURATE": 0.0,
        "PDL": False,
        "TRIGGER": False,
        "PREFETCH": 0,
        "TRACE": False,
    }
    decode = ((128, 4, 3, "fp8"), (128, 8, 3, "fp8"), (64, 4, 3, "fp8"), (32, 2, 2, "fp8"),
              (64, 4, 3, "bf16"))  # fmt: skip
    for n, w, s, dtype in decode:
        ptrs = decode_ptrs if dtype == "fp8" else {**decode_ptrs, "K_buf": BF16, "V_buf": BF16}
        rows.append((f"decode split kernel, {dtype}, {n} keys", _decode_split_kernel, ptrs,
                     {**split, **(fp8 if dtype == "fp8" else bf16), "BLOCK_N": n}, w, s))  # fmt: skip
    ptrs = {**decode_ptrs, "K_buf": BF16, "V_buf": BF16}
    rows.append(("decode split kernel, bf16, 64 keys, merged by the last", _decode_split_kernel,
                 ptrs, {**split, **bf16, "BLOCK_N": 64, "SUM_HERE": True}, 4, 3))  # fmt: skip
    ext = {**common, "PACK": 1, "HAS_WORK": True, "HEAD_GROUPS": 32}
    rows.append(("extend kernel, fp8 pool, 128 x 128", _extend_kernel, extend_ptrs,
                 {**ext, **fp8, "BLOCK_M": 128, "BLOCK_N": 128}, 8, 2))  # fmt: skip
    rows.append(("extend kernel, fp8 pool, 64 x 64", _extend_kernel, extend_ptrs,
                 {**ext, **fp8, "BLOCK_M": 64, "BLOCK_N": 64}, 8, 2))  # fmt: skip
    bf16_ext = {**extend_ptrs, "K_buf": BF16, "V_buf": BF16}
    for w in (4, 8):
        rows.append(("extend kernel, bf16 pool, 64 x 64", _extend_kernel, bf16_ext,
                     {**ext, **bf16, "BLOCK_M": 64, "BLOCK_N": 64}, w, 2))  # fmt: skip
    # the skinny GEMV's Llama-3.1-8B launches at one row, plain and with the norms folded in
    gemv_ptrs = {"X": BF16, "W": BF16, "Bias": BF16, "Out": BF16, "Part": "*fp32",
                 "Counters": "*i32", "Trace": "*i64", "Gamma": BF16, "Squares": "*fp32",
                 "M": "i32", "N": "i32", "K": "i32", "K_SLICE": "i32", "eps": "fp32"}  # fmt: skip
    gemv = {"EVEN": True, "HAS_BIAS": False, "SILU_MUL": False, "DOT_PRECISION": "tf32",
            "ADD_NORM": False, "NORM_X": False, "BLOCK_T": 1, "PDL": True, "TRACE": False}  # fmt: skip
    folded = {"ADD_NORM": True}, {"NORM_X": True, "BLOCK_T": 64}
    for label, (bn, bk, sk, w, s), fold in (
        ("qkv", (64, 128, 1, 4, 4), folded[1]), ("o_proj", (64, 128, 1, 4, 4), folded[0]),
        ("gate_up", (64, 128, 1, 4, 6), folded[1]),
        ("down", (128, 128, 4, 8, 4), folded[0]),
    ):  # fmt: skip
        tiles = {**gemv, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "SUM_HERE": sk > 1,
                 "SILU_MUL": label == "down"}  # fmt: skip
        rows.append((f"gemv {label}", _gemv_kernel, gemv_ptrs, tiles, w, s))
        name = "add_norm" if fold.get("ADD_NORM") else "normed_x"
        rows.append((f"gemv {label}, {name}", _gemv_kernel, gemv_ptrs, {**tiles, **fold}, w, s))
    for label, fn, ptrs, const, warps, stages in rows:
        where = f"{label}, {warps} warps, {stages} stages"
        print(f"  {where:<62} {resources(fn, ptrs, const, warps, stages)}")


if __name__ == "__main__":
    main()
