"""The decode split kernel compiled for sm_90 without a GPU: its shared memory and the PTX
instruction mix of its key loop, per pool dtype and launch (Triton compiles for a target it is
told of; ptxas ships with it). What the ninth session's diagnosis of the fp8 decode rested on.

    python benchmarks/ptx_loop.py                       # bf16 and fp8 (V staged / sunk), defaults
    python benchmarks/ptx_loop.py --dtype fp8 --block-n 64 --warps 8 --dump /tmp/ptx

The loop is the kernel's longest backward branch; instructions are counted statically (one pass
of the loop body, inline PTX included), by opcode and its first qualifier.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from weft.kernels import decode

STRIDES = ["stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
           "stride_rr", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh",
           "stride_outb", "stride_outh", "stride_c", "stride_knb", "stride_knh", "stride_vnb",
           "stride_vnh"]  # fmt: skip


def compile_split_kernel(
    fp8: bool, staged: bool, block_n: int, warps: int, stages: int
) -> triton.compiler.CompiledKernel:
    """The split kernel as the runtime launches it for 32 q / 8 kv heads, d 128, bf16 queries:
    pointers and strides carry the 16-divisibility the launcher specializes on."""
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"Q": "*bf16", "K_buf": kv, "V_buf": kv, "Req_to_token": "*i32", "Req_rows": "*i32",
           "Seq_lens": "*i32", "Kv_starts": "*i32", "Part_o": "*fp32", "Part_lse": "*fp32",
           "Out": "*bf16", "Positions": "*i32", "Cos_sin": "*fp32", "K_new": "*bf16",
           "V_new": "*bf16", "Loc": "*i32", "Counters": "*i32", "Prefetch": "*u8",
           "prefetch_bytes": "i32", "Trace": "*i64", "qk_scale": "fp32", "num_splits": "i32", "num_prefix_splits": "i32",
           "col0": "i32"}  # fmt: skip
    sig.update(dict.fromkeys(STRIDES, "i32"))
    consts = {"G": 4, "D": 128, "BLOCK_H": 16, "BLOCK_D": 128, "BLOCK_N": block_n,
              "PREFIX_BLOCK_N": 64, "DOT_PRECISION": "tf32", "FP16_DOTS": fp8, "HAS_KV_STARTS": False,
              "V_STAGED": fp8 and staged, "DIRECT": False, "SUM_HERE": False, "BLOCK_S": 32,
              "ROPE": False, "SATURATE": 0.0, "PDL": False, "TRIGGER": False, "PREFETCH": 0,
              "TRACE": False}  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(decode._decode_split_kernel, sig, consts, attrs)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(
        src,
        target=target,
        options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True},
    )


def loop_body(ptx: str) -> list[str]:
    """The statements of the longest loop's body (an inline-PTX block split into its own)."""
    lines = ptx.splitlines()
    labels = {
        m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__\w+):", line))
    }
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            best = max(best, (i - labels[m.group(1)], labels[m.group(1)]), key=lambda b: b[0])
    length, start = best
    body = []
    for line in lines[start : start + length]:
        text = line.strip()
        # an inline-PTX block is one line `{ stmt; stmt; }`; other braces enclose operands
        stmts = text.strip("{} ").split(";") if text.startswith("{") else [text]
        for stmt in map(str.strip, stmts):
            if not stmt or stmt.startswith(("$", "//", ".", "}")):
                continue
            body.append(stmt.split(None, 1)[1] if stmt.startswith("@") else stmt)
    return body


def loop_mix(ptx: str) -> collections.Counter[str]:
    """Opcodes (with their first qualifier) of the longest loop's body."""
    return collections.Counter(".".join(s.split()[0].split(".")[:2]) for s in loop_body(ptx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "fp8", "both"], default="both")
    ap.add_argument("--block-n", type=int, default=None, help="default: the runtime's")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per kernel")
    ap.add_argument(
        "--dump", type=Path, default=None, help="write each kernel's ttgir and ptx here"
    )
    args = ap.parse_args()
    cases = [("bf16", False, False), ("fp8", True, False), ("fp8", True, True)]
    for name, fp8, staged in cases:
        if args.dtype not in ("both", name):
            continue
        block_n = args.block_n or (128 if fp8 else 64)
        kernel = compile_split_kernel(fp8, staged, block_n, args.warps, args.stages)
        mix = loop_mix(kernel.asm["ptx"])
        label = f"{name}{' V staged' if staged else ' V sunk' if fp8 else ''}"
        print(f"{label}: block_n {block_n}, warps {args.warps}, stages {args.stages}, "
              f"shared {kernel.metadata.shared} B, loop {sum(mix.values())} instructions")  # fmt: skip
        print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top)))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            tag = label.replace(" ", "_")
            for ir in ("ttgir", "ptx"):
                (args.dump / f"{tag}.{ir}").write_text(kernel.asm[ir])


if __name__ == "__main__":
    main()
