"""An experiment for the fp8 decode: V stored transposed within each page ([pages, Hkv, D, page]),
so a V tile needs no trip through shared memory for its layout, against the runtime's walk.

The runtime's fp8 walk converts each V tile where it is loaded, stores it to shared memory as
float16 and reads it back transposed (V_STAGED, kernels/attend.py). Nsight Compute put that
kernel's bound on the SM side (BENCHMARKS.md, seventeenth session). With keys contiguous inside a
page, a V^T tile converts in the dot's operand layout as K's tiles already do.

    TRITON_INTERPRET=1 python benchmarks/decode_vt.py --check   # CPU: the walks vs torch
    python benchmarks/decode_vt.py --ptx      # any machine: their shared-memory ops, sm_90
    python benchmarks/decode_vt.py            # CUDA: the walks timed against the copy ceiling
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from weft.kernels.attend import LOG2E, _attend
from weft.kernels.decode import fp8_v_staging
from weft.kernels.reference import decode_attention_ref

PAGE = 16


@triton.jit
def _attend_vt(  # type: ignore[no-untyped-def]
    q,  # [BLOCK_H, D] float16
    K_buf,  # [num_slots, Hkv, D] e4m3
    Vt_buf,  # [num_pages, Hkv, D, PAGE] e4m3
    Tokens,
    end,
    kvh,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vh,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """_attend over keys [0, end) with V read as per-page transposed tiles (position i of the
    request at offset i % PAGE of its page, as the runtime allocates)."""
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < end
        slot = tl.load(Tokens + n, mask=n_mask, other=0).to(tl.int64)
        k_ptrs = K_buf + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # each key's page: the slot of its page's first key // PAGE (the same for PAGE keys, so
        # the tile's addresses run in PAGE-long contiguous pieces along the keys)
        first = tl.load(Tokens + n0 + (offs_n // PAGE) * PAGE, mask=n_mask, other=0)
        key_off = (first // PAGE).to(tl.int64) * stride_vp + offs_n % PAGE
        key_off = tl.max_contiguous(tl.multiple_of(key_off, PAGE), PAGE)  # 16-byte pieces
        vt_ptrs = Vt_buf + kvh * stride_vh + offs_d[:, None] * PAGE + key_off[None, :]
        # NOTE: no load mask (a mask varying along the keys would split the 16-byte loads):
        # keys past the walk read their page's stale slots or the reserved page 0 (table
        # entries past a request's length), in bounds either way. Their p is 0, so only a
        # non-finite stale value could reach the output: ZERO_TAIL zeroes them (but then the
        # compiler stages V through shared memory again); without it the pool must hold only
        # finite values (zero-initialised, and every store is finite)
        v = tl.trans(tl.load(vt_ptrs).to(tl.float16))  # [BLOCK_N, D]
        if ZERO_TAIL:
            v = tl.where(n_mask[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _walk_kernel(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D]
    K_buf,
    V_buf,  # [num_slots, Hkv, D], or [num_pages, Hkv, D, PAGE] with VT
    Req_to_token,
    Req_rows,
    Seq_lens,
    Out,  # [B, H, D]
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,  # per slot, or per page with VT
    stride_vh,
    stride_rr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    VT: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    """One program per (request, kv head): its whole walk, written to Out."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(Req_rows + b).to(tl.int64)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    h_mask = offs_h < G
    heads = kvh * G + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0).to(tl.float16)  # fmt: skip
    tokens = Req_to_token + row * stride_rr
    if VT:
        acc, m_i, l_i = _attend_vt(q, K_buf, V_buf, tokens, seq_len, kvh, qk_scale, stride_kt,
                                   stride_kh, stride_vt, stride_vh, BLOCK_H, D, BLOCK_N, PAGE,
                                   ZERO_TAIL)  # fmt: skip
    else:
        acc, m_i, l_i = _attend(q, K_buf, V_buf, tokens, 0, seq_len, kvh, qk_scale, stride_kt,
                                stride_kh, stride_vt, stride_vh, BLOCK_H, D, D, BLOCK_N, "tf32",
                                True, V_STAGED)  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = Out + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=h_mask[:, None])


def to_vt(v: torch.Tensor) -> torch.Tensor:
    """[num_slots, Hkv, D] -> [num_pages, Hkv, D, PAGE]: each page's keys contiguous."""
    slots, hkv, d = v.shape
    return v.view(slots // PAGE, PAGE, hkv, d).permute(0, 2, 3, 1).contiguous()


VARIANTS = {  # name: (VT, ZERO_TAIL)
    "runtime walk (V staged)": (False, False),
    "V^T pages, tail zeroed": (True, True),
    "V^T pages (finite pool)": (True, False),
}


def walk(args: dict[str, Any], variant: str, block_n: int, warps: int, stages: int) -> torch.Tensor:
    vt, zero_tail = VARIANTS[variant]
    q, k, v, out = args["q"], args["k_buffer"], args["v_fp8_t" if vt else "v_buffer"], args["out"]
    table = args["req_to_token"]
    bsz, heads, dim = q.shape
    hkv = k.shape[1]
    _walk_kernel[(bsz, hkv)](
        q, k, v, table, args["req_rows"], args["seq_lens"], out, args["scale"] * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        table.stride(0), G=heads // hkv, D=dim, BLOCK_H=16, BLOCK_N=block_n, PAGE=PAGE, VT=vt,
        ZERO_TAIL=zero_tail, V_STAGED=not vt and fp8_v_staging(q, k), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def setup(
    lens: list[int], hkv: int, heads: int, dim: int, device: str, poison: bool = False
) -> dict[str, Any]:
    from kernels import random_pool

    k, v, table, rows = random_pool(lens, PAGE, hkv, dim, torch.bfloat16, device, poison)
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    return {
        "q": torch.randn(len(lens), heads, dim, dtype=torch.bfloat16, device=device),
        "k_buffer": k, "v_buffer": v, "v_fp8_t": to_vt(v), "req_to_token": table,
        "req_rows": rows, "seq_lens": torch.tensor(lens, device=device),
        "out": torch.empty(len(lens), heads, dim, dtype=torch.bfloat16, device=device),
        "scale": dim**-0.5,
    }  # fmt: skip


def check(device: str) -> None:
    """Every walk against the float32 reference on ragged lengths (tails inside a page); with
    the slots no request owns poisoned (NaN), all but the one that needs a finite pool."""
    for poison in (False, True):
        torch.manual_seed(0)
        args = setup([37, 16, 50, 1, 128], 2, 8, 64, device, poison)
        want = decode_attention_ref(*(args[k] for k in ("q", "k_buffer", "v_buffer",
                                    "req_to_token", "req_rows", "seq_lens", "scale")))  # fmt: skip
        for variant in VARIANTS:
            if poison and variant == "V^T pages (finite pool)":
                continue
            got = walk(args, variant, 32, 4, 2).float()
            err = ((got - want).norm() / want.norm()).item()
            print(f"{variant}{', NaN-poisoned pool' if poison else ''}: relative error {err:.2e}")
            assert err < 2e-2, err


def ptx_counts() -> None:
    """Shared-memory and conversion instructions of the walks, compiled for sm_90 with the
    launches' specialization (see kernel_resources.py)."""
    from kernel_resources import compile_sm90

    ptrs = {"Q": "*bf16", "K_buf": "*fp8e4nv", "V_buf": "*fp8e4nv", "Out": "*bf16",
            "Req_to_token": "*i64", "Seq_lens": "*i64", "Req_rows": "*i64"}  # fmt: skip
    ops = r"(st\.shared[.\w]*|ld\.shared[.\w]*|ldmatrix[.\w]*|cvt\.rn\.f16x2\.e4m3x2|mma\.sync)"
    for variant, (vt, zero_tail) in VARIANTS.items():
        const = {"G": 4, "D": 128, "BLOCK_H": 16, "BLOCK_N": 128, "PAGE": PAGE, "VT": vt,
                 "ZERO_TAIL": zero_tail, "V_STAGED": not vt}  # fmt: skip
        kernel = compile_sm90(_walk_kernel, ptrs, const, 4, 3)
        counts = Counter(m.group(1) for m in re.finditer(ops, kernel.asm["ptx"]))
        print(f"{variant}, 128 keys, 4 warps: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))  # fmt: skip


def bench() -> None:
    """The walks at the offline run's batch (512 x 1536), a small batch and the prefix-sharing
    run's own walks (1,024 x 256), with the runtime's decode_attention at its own launch."""
    from kernels import copy_gbps, decode_bytes, time_ms
    from weft.kernels import decode_attention, decode_num_kv_splits

    ceiling = copy_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s; fp8 pool, 32 q / 8 kv heads")
    for bsz, kv in ((512, 1536), (64, 2048), (1024, 256)):
        args = setup([kv] * bsz, 8, 32, 128, "cuda")
        nbytes = decode_bytes(bsz, kv, kv_bytes=1)
        fixed = {k: args[k] for k in ("q", "k_buffer", "v_buffer", "req_to_token", "req_rows",
                                      "seq_lens", "out", "scale")}  # fmt: skip
        splits = decode_num_kv_splits(bsz, 8, kv, sms)
        ms = time_ms(partial(decode_attention, **fixed, num_kv_splits=splits))
        print(f"  batch {bsz}, kv {kv}: the runtime's decode_attention ({splits} splits) "
              f"{ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}")  # fmt: skip
        for variant in VARIANTS:
            cells = []
            for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 2)):
                ms = time_ms(partial(walk, args, variant, bn, w, st))
                cells.append(f"{bn}/{w}/{st} {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}")
            print(f"  batch {bsz}, kv {kv}, {variant} (keys/warps/stages): " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="CPU (TRITON_INTERPRET=1) correctness")
    ap.add_argument("--ptx", action="store_true", help="sm_90 instruction counts (no GPU needed)")
    args = ap.parse_args()
    if args.check:
        check("cpu")
    elif args.ptx:
        ptx_counts()
    else:
        check("cuda")
        bench()


if __name__ == "__main__":
    main()
