"""SharedPrefix and decode attention's cascade stage: a shared KV prefix read once per block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attend import LOG2E, _attend, fp8_v_staging, fp16_dots
from .splits import _split_range


@dataclass(frozen=True)
class SharedPrefix:
    """Requests of a decode batch that share a prefix of their KV (the same slots).

    One program per (block, tile of its members, kv head, split) reads its split of the prefix
    req_to_token[block_rows[i], :block_lens[i]] once, with the q heads of all its tile's members as
    one query tile, and writes their partials into column num_kv_splits + split. `block_n`,
    `num_warps` and `num_stages` override that kernel's launch (None: the defaults), for tuning.
    """

    block_members: torch.Tensor  # [NB, M] int32: batch indices of a block's members, -1 = none
    block_rows: torch.Tensor  # [NB] int32: a req_to_token row whose first block_lens[i] slots ...
    block_lens: torch.Tensor  # [NB] int32: ... are the shared prefix; 0 = an unused block
    num_splits: int  # splits of the prefix per block (columns of the partials it writes)
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        nb = self.block_members.shape[0]
        if self.block_members.dim() != 2 or self.block_members.shape[1] < 1:
            raise ValueError(f"block_members must be [NB, M >= 1], got {self.block_members.shape}")
        if self.block_rows.shape != (nb,) or self.block_lens.shape != (nb,):
            raise ValueError(f"block_rows {tuple(self.block_rows.shape)} and block_lens "
                             f"{tuple(self.block_lens.shape)} must be [{nb}]")  # fmt: skip
        if self.num_splits < 1 or (self.block_n is not None and self.block_n < 16):
            raise ValueError(f"num_splits {self.num_splits} < 1 or block_n {self.block_n} < 16")


@triton.jit
def _prefix_split_kernel(  # type: ignore[no-untyped-def]
    Q,  # [B, H, D]
    K_buf,  # [num_slots, Hkv, D]
    V_buf,
    Req_to_token,  # [max_reqs, max_context]
    Block_members,  # [NB, M] batch indices, -1 = none
    Block_rows,  # [NB]
    Block_lens,  # [NB]
    Part_o,  # [B, H, S, D] float32; this kernel writes columns col0 + split
    Part_lse,  # [B, H, S] float32
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    col0,
    num_members,  # M
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    stride_bm,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    G: tl.constexpr,  # q heads per kv head
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # members per program
    BLOCK_R: tl.constexpr,  # query rows: BLOCK_M * G padded to a power of 2 >= 16
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    tiles = tl.cdiv(num_members, BLOCK_M)
    blk = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(Block_lens + blk).to(tl.int32)
    start, end, _ = _split_range(prefix_len, num_splits, split, BLOCK_N)
    if end > start:
        # query row r: member r // G of this tile, its q head kvh * G + r % G
        offs_r = tl.arange(0, BLOCK_R)
        offs_d = tl.arange(0, BLOCK_D)
        local = offs_r // G
        idx = tile * BLOCK_M + local
        in_tile = (local < BLOCK_M) & (idx < num_members)
        member = tl.load(Block_members + blk * stride_bm + idx, mask=in_tile, other=-1)
        r_mask = in_tile & (member >= 0)
        member = tl.where(r_mask, member, 0).to(tl.int64)  # [BLOCK_R] batch index
        heads = kvh * G + offs_r % G  # [BLOCK_R]
        rd_mask = r_mask[:, None] & (offs_d < D)[None, :]
        q_ptrs = Q + member[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=rd_mask, other=0.0)  # [BLOCK_R, BLOCK_D]
        row = tl.load(Block_rows + blk).to(tl.int64)
        acc, m_i, l_i = _attend(
            q, K_buf, V_buf, Req_to_token + row * stride_rr, start, end,
            kvh, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
            BLOCK_R, D, BLOCK_D, BLOCK_N, DOT_PRECISION, FP16_DOTS, V_STAGED,
        )  # fmt: skip
        col = col0 + split
        o_ptrs = Part_o + member[:, None] * stride_ob + heads[:, None] * stride_oh + col * stride_os
        tl.store(o_ptrs + offs_d[None, :], acc / l_i[:, None], mask=rd_mask)
        lse_ptrs = Part_lse + member * stride_lb + heads * stride_lh + col
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=r_mask)


def shared_prefix_splits(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context]
    shared: SharedPrefix,
    partials: tuple[torch.Tensor, torch.Tensor],  # float32 [B', H, S', D], [B', H, S']
    scale: float,
    col0: int,  # first partial column of the prefix splits
    block_n: int,  # keys per tile; a split covers a whole number of them
) -> None:
    """Stage 1 over the shared prefixes: the members' partials of split p go to column col0 + p."""
    nb, members = shared.block_members.shape
    if nb == 0:
        return
    part_o, part_lse = partials
    fp32 = q.dtype == torch.float32
    group = q.shape[1] // k_buffer.shape[1]
    # a query tile of at most 64 rows (32 in fp32): members x their G q heads
    block_m = max(1, min(members, (32 if fp32 else 64) // group))
    tiles = triton.cdiv(members, block_m)
    f16 = fp16_dots(q, k_buffer)
    # NOTE: over an fp8 pool (128-key tiles) 2 stages beat 3: 140.8 vs 145.6 us; over bf16 (64
    # keys) 3 beat 2: 163.0 vs 260.4 us (64 groups x 16 on 2048; `benchmarks/kernel.py shared --pools`)
    stages = shared.num_stages or (2 if fp32 or f16 else 3)
    _prefix_split_kernel[(nb * tiles, k_buffer.shape[1], shared.num_splits)](
        q, k_buffer, v_buffer, req_to_token,
        shared.block_members, shared.block_rows, shared.block_lens, part_o, part_lse,
        scale * LOG2E, shared.num_splits, col0, members,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        shared.block_members.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        G=group, D=q.shape[2], BLOCK_M=block_m,
        BLOCK_R=max(16, triton.next_power_of_2(block_m * group)),
        BLOCK_D=triton.next_power_of_2(q.shape[2]), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if fp32 else "tf32", FP16_DOTS=f16,
        V_STAGED=fp8_v_staging(q, k_buffer),
        num_warps=shared.num_warps or (8 if fp32 else 4), num_stages=stages,
    )  # fmt: skip
