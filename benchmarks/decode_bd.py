"""An experiment for the fp8 decode: one program walks several kv heads at once with a
block-diagonal query, so every row of the 16-row tiles that mma needs is a real query head.

The runtime's walk serves the G = 4 q heads of one kv head with 16-row tiles: 12 of the 16
rows of every score tile are padding, and the softmax (max, exp2, sums) runs on all 16. Here a
program takes HG = 16 / G kv heads: q is [16, HG * D] with row r holding its head's query in
the D columns of its kv head and zeros elsewhere, and a key tile is [BLOCK_N, HG * D] (the HG
heads of each slot, contiguous in the pool). Then q . k^T gives each row exactly its own head's
scores, p . v gives each row its own head's output in its kv head's D columns, and the
softmax work per key falls by HG. The dots do HG times the multiply-adds, all of them real
work now instead of padding.

    TRITON_INTERPRET=1 python benchmarks/decode_bd.py --check   # CPU: against the reference
    python benchmarks/decode_bd.py            # CUDA: timed beside the runtime's walk
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl
from decode_vt import setup, walk

from weft.kernels.attend import LOG2E, _e4m3_to_f16_here
from weft.kernels.decode import fp8_v_staging
from weft.kernels.reference import decode_attention_ref


@triton.jit
def _bd_kernel(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D]
    K_buf,  # [num_slots, Hkv, D], heads contiguous (stride_kh == D)
    V_buf,
    Req_to_token,
    Req_rows,
    Seq_lens,
    Out,  # [B, H, D]
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_vt,
    stride_rr,
    G: tl.constexpr,
    D: tl.constexpr,
    HG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    """One program per (request, group of HG kv heads): its whole walk, written to Out."""
    R: tl.constexpr = HG * G
    W: tl.constexpr = HG * D
    b = tl.program_id(0)
    grp = tl.program_id(1)
    row = tl.load(Req_rows + b).to(tl.int64)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, W)
    offs_n = tl.arange(0, BLOCK_N)
    diag = (offs_c[None, :] // D) == (offs_r[:, None] // G)  # row r's own kv head's columns
    heads = grp * R + offs_r
    qo_off = b * stride_qb + heads[:, None] * stride_qh + (offs_c % D)[None, :]
    q = tl.load(Q + qo_off, mask=diag, other=0.0).to(tl.float16)
    cols = grp * W + offs_c  # the group's HG heads of a slot
    tokens = Req_to_token + row * stride_rr
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, W], tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < seq_len
        slot = tl.load(tokens + n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K_buf + slot[:, None] * stride_kt + cols[None, :], mask=n_mask[:, None],
                    other=0.0).to(tl.float16)  # fmt: skip
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vt + cols[None, :], mask=n_mask[:, None],
                    other=0.0)  # fmt: skip
        if V_STAGED:
            v = _e4m3_to_f16_here(v)
        else:
            v = v.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + qo_off, o.to(Out.dtype.element_ty), mask=diag)


def walk_bd(args: dict[str, Any], block_n: int, warps: int, stages: int) -> torch.Tensor:
    q, k, v, out = args["q"], args["k_buffer"], args["v_buffer"], args["out"]
    table = args["req_to_token"]
    bsz, heads, dim = q.shape
    hkv = k.shape[1]
    g = heads // hkv
    hg = max(1, 16 // g)
    if hkv % hg or k.stride(1) != dim or v.stride(1) != dim:
        raise ValueError(f"{hkv} kv heads do not split into groups of {hg} contiguous heads")
    _bd_kernel[(bsz, hkv // hg)](
        q, k, v, table, args["req_rows"], args["seq_lens"], out, args["scale"] * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), v.stride(0), table.stride(0), G=g, D=dim, HG=hg,
        BLOCK_N=block_n, V_STAGED=fp8_v_staging(q, k), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def check(device: str) -> None:
    """The walk against the float32 reference on ragged lengths, with unowned slots NaN."""
    for poison, hkv in ((False, 4), (True, 8)):
        torch.manual_seed(0)
        args = setup([37, 16, 50, 1, 128], hkv, 4 * hkv, 64, device, poison)
        want = decode_attention_ref(*(args[k] for k in ("q", "k_buffer", "v_buffer",
                                    "req_to_token", "req_rows", "seq_lens", "scale")))  # fmt: skip
        got = walk_bd(args, 16, 4, 2).float()
        err = ((got - want).norm() / want.norm()).item()
        print(f"block-diagonal walk{', NaN-poisoned pool' if poison else ''}: error {err:.2e}")
        assert err < 2e-2, err


LAUNCHES = ((16, 4, 3), (32, 4, 3), (32, 8, 3), (64, 8, 2), (16, 4, 4), (32, 4, 2))


def bench() -> None:
    from kernels import copy_gbps, decode_bytes, time_ms

    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s; fp8 pool, 32 q / 8 kv heads")
    for bsz, kv in ((512, 1536), (64, 2048), (1024, 256)):
        args = setup([kv] * bsz, 8, 32, 128, "cuda")
        nbytes = decode_bytes(bsz, kv, kv_bytes=1)
        want = walk(args, "runtime walk (V staged)", 128, 4, 3).clone()
        ms = time_ms(partial(walk, args, "runtime walk (V staged)", 128, 4, 3))
        cells = [f"runtime walk 128/4/3 {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}"]
        for bn, w, st in LAUNCHES:
            got = walk_bd(args, bn, w, st)
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, (bn, w, st, err)
            ms = time_ms(partial(walk_bd, args, bn, w, st))
            cells.append(f"{bn}/{w}/{st} {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}")
        print(f"  batch {bsz}, kv {kv}, block-diagonal (keys/warps/stages): " + " | ".join(cells))


def ncu_once() -> None:
    """Each walk once at batch 512, kv 1536 (for `ncu --kernel-name regex:_kernel`)."""
    args = setup([1536] * 512, 8, 32, 128, "cuda")
    walk(args, "runtime walk (V staged)", 128, 4, 3)
    walk_bd(args, 32, 4, 3)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="CPU (TRITON_INTERPRET=1) correctness")
    ap.add_argument("--ncu", action="store_true", help="each walk once, for Nsight Compute")
    args = ap.parse_args()
    if args.check:
        check("cpu")
    elif args.ncu:
        ncu_once()
    else:
        check("cuda")
        bench()


if __name__ == "__main__":
    main()
