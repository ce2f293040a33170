"""Token bitmasks: allocate the int32 [B, ceil(V/32)] buffer and apply it to logits (CPU or CUDA)."""

from __future__ import annotations

import torch


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An int32 [batch, ceil(vocab_size/32)] CPU mask, all allowed (pinned where CUDA exists)."""
    pin = torch.cuda.is_available()
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
) -> None:
    """In place: logits of disallowed tokens -> -inf. Works on CPU and CUDA logits.

    logits: [B, V] float; bitmask: int32 [M, W] (moved to logits' device); rows: optional int64
    [R] logit rows that are masked (unconstrained rows are then left untouched; default: all B);
    mask_rows: optional int64 [R] bitmask row of each masked logit row (default: rows 0..R-1 in
    order, M == R). Columns at or beyond 32*W are disallowed.
    """
    device = logits.device
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    mask = bitmask.to(device, non_blocking=True)
    if mask_rows is not None:
        mask = mask.index_select(0, mask_rows.to(device))  # [R, W]
    n_rows, vocab = (logits.shape[0] if rows is None else rows.numel()), logits.shape[1]
    assert mask.shape[0] == n_rows, f"bitmask rows {mask.shape[0]} != logit rows {n_rows}"
    width = min(vocab, 32 * mask.shape[1])
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(n_rows, -1)[:, :width].bool()  # [R, width]
    target = logits if rows is None else logits.index_select(0, rows)
    target[:, :width].masked_fill_(~allowed, float("-inf"))
    target[:, width:] = float("-inf")
    if rows is not None:
        logits.index_copy_(0, rows, target)
