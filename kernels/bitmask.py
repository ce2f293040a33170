"""Grammar token bitmask applied to logits in place: disallowed tokens -> -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._check import INDEX_DTYPES, check_tensor

BLOCK = 2048


@triton.jit
def _bitmask_kernel(  # type: ignore[no-untyped-def]
    Logits,  # [B, V]
    Mask,  # [R, W] int32
    Rows,  # [R] logit row of each mask row (unused unless HAS_ROWS)
    stride_l,
    stride_m,
    vocab,
    width,
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
    HAS_ROWS: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(Rows + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    offs_w = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)  # [BLOCK/32] word ids
    # NOTE: words at or past W read as 0, so tokens without a bit count as disallowed
    words = tl.load(Mask + i * stride_m + offs_w, mask=offs_w < width, other=0)
    bit = tl.arange(0, 32)
    allowed = (words[:, None] >> bit[None, :]) & 1  # [BLOCK/32, 32]
    tokens = offs_w[:, None] * 32 + bit[None, :]  # [BLOCK/32, 32]
    neg_inf = tl.full([BLOCK // 32, 32], float("-inf"), tl.float32).to(Logits.dtype.element_ty)
    # only the disallowed logits are written; allowed ones are neither read nor written
    tl.store(Logits + row * stride_l + tokens, neg_inf, mask=(tokens < vocab) & (allowed == 0))


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V] float, masked in place
    bitmask: torch.Tensor,  # [R, W] int32 on logits' device; bit i of word w allows 32*w + i
    rows: torch.Tensor | None = None,  # [R] int logit row of each mask row; None: R == B
) -> None:
    """In place: logits[rows[r], t] = -inf where bit t of bitmask[r] is 0 or t >= 32 * W."""
    bsz, vocab = logits.shape
    num_masks, width = bitmask.shape
    dev = logits.device
    check_tensor(logits, "logits", (bsz, vocab), (torch.float16, torch.bfloat16, torch.float32))
    check_tensor(bitmask, "bitmask", (num_masks, width), (torch.int32,), dev)
    if rows is None:
        assert num_masks == bsz, f"bitmask has {num_masks} rows for {bsz} logit rows; pass rows"
    else:
        check_tensor(rows, "rows", (num_masks,), INDEX_DTYPES, dev)
    if num_masks == 0 or vocab == 0:
        return
    _bitmask_kernel[(num_masks, triton.cdiv(vocab, BLOCK))](
        logits, bitmask, bitmask if rows is None else rows, logits.stride(0), bitmask.stride(0),
        vocab, width, BLOCK=BLOCK, HAS_ROWS=rows is not None, num_warps=4,
    )  # fmt: skip
