"""Grammar token bitmask applied to logits in place: disallowed tokens -> -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, INDEX_DTYPES, check_tensor

BLOCK = 2048


@triton.jit
def _bitmask_kernel(  # type: ignore[no-untyped-def]
    Logits,  # [B, V]
    Mask,  # [M, W] int32
    Rows,  # [R] logit row of each masked row (unused unless HAS_ROWS)
    MaskRows,  # [R] mask row of each masked row (unused unless HAS_MASK_ROWS)
    stride_l,
    stride_m,
    vocab,
    width,
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
    HAS_ROWS: tl.constexpr,
    HAS_MASK_ROWS: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(Rows + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    if HAS_MASK_ROWS:
        mask_row = tl.load(MaskRows + i).to(tl.int64)
    else:
        mask_row = i.to(tl.int64)
    offs_w = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)  # [BLOCK/32] word ids
    # NOTE: words at or past W read as 0, so tokens without a bit count as disallowed
    words = tl.load(Mask + mask_row * stride_m + offs_w, mask=offs_w < width, other=0)
    bit = tl.arange(0, 32)
    allowed = (words[:, None] >> bit[None, :]) & 1  # [BLOCK/32, 32]
    tokens = offs_w[:, None] * 32 + bit[None, :]  # [BLOCK/32, 32]
    neg_inf = tl.full([BLOCK // 32, 32], float("-inf"), tl.float32).to(Logits.dtype.element_ty)
    # only the disallowed logits are written; allowed ones are neither read nor written
    tl.store(Logits + row * stride_l + tokens, neg_inf, mask=(tokens < vocab) & (allowed == 0))


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V] float, masked in place
    bitmask: torch.Tensor,  # [M, W] int32 on logits' device; bit i of word w allows 32*w + i
    rows: torch.Tensor | None = None,  # [R] int logit row of each masked row; None: R == B
    mask_rows: torch.Tensor | None = None,  # [R] int bitmask row of each masked row; None: R == M
) -> None:
    """In place: logits[rows[r], t] = -inf where bit t of bitmask[mask_rows[r]] is 0 or
    t >= 32 * W (rows, mask_rows default to 0..R-1)."""
    bsz, vocab = logits.shape
    num_bitmask, width = bitmask.shape
    dev = logits.device
    check_tensor(logits, "logits", (bsz, vocab), FLOATS)
    check_tensor(bitmask, "bitmask", (num_bitmask, width), (torch.int32,), dev)
    num_masks = num_bitmask if mask_rows is None else mask_rows.numel()
    if mask_rows is not None:
        check_tensor(mask_rows, "mask_rows", (num_masks,), INDEX_DTYPES, dev)
    if rows is None:
        assert num_masks == bsz, f"{num_masks} masked rows for {bsz} logit rows; pass rows"
    else:
        check_tensor(rows, "rows", (num_masks,), INDEX_DTYPES, dev)
    if num_masks == 0 or vocab == 0:
        return
    _bitmask_kernel[(num_masks, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, bitmask if rows is None else rows,
        bitmask if mask_rows is None else mask_rows, logits.stride(0), bitmask.stride(0),
        vocab, width, BLOCK=BLOCK, HAS_ROWS=rows is not None, HAS_MASK_ROWS=mask_rows is not None,
        num_warps=4,
    )  # fmt: skip
