"""An experiment for short decode walks (large batches of short contexts, and the own keys behind
a shared prefix): one program walks R requests of a kv head as one long walk.

The runtime's decode walk runs one program per (request, kv head): at 256 keys that is two
128-key tiles, so each program is mostly its pipeline's fill and drain, and 12 of the 16 rows
of its tiles are padding (G = 4 q heads). Here a program takes R = 16 / G consecutive requests:
its 16 query rows are their q heads, its keys are their walks one after another, and a key tile
(which may hold keys of several of them) scores against all rows with the other requests' keys
masked. Same tiles, same work per key; R times fewer and R times longer walks.

    TRITON_INTERPRET=1 python benchmarks/decode_packed.py --check   # CPU: against the reference
    python benchmarks/decode_packed.py            # CUDA: timed beside the runtime's walk
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
def _packed_kernel(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D]
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Req_to_token,
    Req_rows,
    Seq_lens,
    Out,  # [B, H, D]
    qk_scale,
    bsz,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    G: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,  # requests per program
    ROWS: tl.constexpr,  # R * G, at least 16
    BLOCK_N: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    """One program per (R consecutive requests, kv head): their walks back to back."""
    pb = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_q = tl.arange(0, R)
    b_q = pb * R + offs_q
    lens = tl.load(Seq_lens + b_q, mask=b_q < bsz, other=0).to(tl.int32)
    rows = tl.load(Req_rows + b_q, mask=b_q < bsz, other=0).to(tl.int64)
    ends = tl.cumsum(lens, 0)
    starts = ends - lens
    total = tl.sum(lens, 0)
    offs_r = tl.arange(0, ROWS)
    rq = offs_r // G  # each row's request within the program (R and beyond: padding)
    b_r = pb * R + rq
    r_ok = (rq < R) & (b_r < bsz)
    heads = kvh * G + offs_r % G
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    qo_off = b_r[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + qo_off, mask=r_ok[:, None], other=0.0).to(tl.float16)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for n0 in range(0, total, BLOCK_N):
        j = n0 + offs_n
        valid = j < total
        req = tl.sum((j[:, None] >= ends[None, :]).to(tl.int32), 1)  # [BLOCK_N] in [0, R]
        pick = req[:, None] == offs_q[None, :]
        row_j = tl.sum(tl.where(pick, rows[None, :], 0), 1)
        pos_j = j - tl.sum(tl.where(pick, starts[None, :], 0), 1)
        slot = tl.load(Req_to_token + row_j * stride_rr + pos_j, mask=valid, other=0).to(tl.int64)
        k = tl.load(K_buf + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float16)  # fmt: skip
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where((rq[:, None] == req[None, :]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row none of whose keys is here
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # fmt: skip
        if V_STAGED:
            v = _e4m3_to_f16_here(v)
        else:
            v = v.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + qo_off, o.to(Out.dtype.element_ty), mask=r_ok[:, None])


def walk_packed(args: dict[str, Any], r: int, block_n: int, warps: int, stages: int) -> Any:
    q, k, v, out = args["q"], args["k_buffer"], args["v_buffer"], args["out"]
    table = args["req_to_token"]
    bsz, heads, dim = q.shape
    hkv = k.shape[1]
    g = heads // hkv
    _packed_kernel[(triton.cdiv(bsz, r), hkv)](
        q, k, v, table, args["req_rows"], args["seq_lens"], out, args["scale"] * LOG2E, bsz,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        table.stride(0), G=g, D=dim, R=r, ROWS=max(16, r * g), BLOCK_N=block_n,
        V_STAGED=fp8_v_staging(q, k), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def check(device: str) -> None:
    """Against the float32 reference on ragged lengths (one of them 1, a batch not a multiple
    of R), with the slots no request owns NaN."""
    for poison in (False, True):
        torch.manual_seed(0)
        args = setup([37, 16, 50, 1, 128, 70, 5], 2, 8, 64, device, poison)
        want = decode_attention_ref(*(args[k] for k in ("q", "k_buffer", "v_buffer",
                                    "req_to_token", "req_rows", "seq_lens", "scale")))  # fmt: skip
        for r in (2, 4):
            got = walk_packed(args, r, 32, 4, 2).float()
            err = ((got - want).norm() / want.norm()).item()
            print(f"packed walk, {r} requests{', NaN-poisoned pool' if poison else ''}: "
                  f"error {err:.2e}")  # fmt: skip
            assert err < 2e-2, err


LAUNCHES = ((4, 64, 4, 3), (4, 128, 4, 3), (4, 128, 4, 2), (4, 64, 4, 4), (2, 128, 4, 3),
            (8, 64, 4, 3))  # fmt: skip


def bench() -> None:
    from kernels import copy_gbps, decode_bytes, time_ms

    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name(0)}: copy {ceiling:.0f} GB/s; fp8 pool, 32 q / 8 kv heads")
    for bsz, kv in ((1024, 160), (1024, 256), (1024, 384), (512, 1536), (64, 2048)):
        args = setup([kv] * bsz, 8, 32, 128, "cuda")
        nbytes = decode_bytes(bsz, kv, kv_bytes=1)
        cells = []
        for bn, w, st in ((128, 4, 3), (32, 2, 2)):
            ms = time_ms(partial(walk, args, "runtime walk (V staged)", bn, w, st))
            cells.append(
                f"runtime {bn}/{w}/{st} {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}"
            )
        want = walk(args, "runtime walk (V staged)", 128, 4, 3).float().clone()
        for r, bn, w, st in LAUNCHES:
            got = walk_packed(args, r, bn, w, st).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, (r, bn, w, st, err)
            ms = time_ms(partial(walk_packed, args, r, bn, w, st))
            cells.append(f"R{r} {bn}/{w}/{st} {ms * 1e3:.1f} us {nbytes / ms / 1e6 / ceiling:.0%}")
        print(f"  batch {bsz}, kv {kv} (requests, keys/warps/stages): " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="CPU (TRITON_INTERPRET=1) correctness")
    args = ap.parse_args()
    if args.check:
        check("cpu")
    else:
        check("cuda")
        bench()


if __name__ == "__main__":
    main()
