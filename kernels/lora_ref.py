"""Multi-LoRA in plain PyTorch: the loop over adapters that kernels/lora.py must match."""

from __future__ import annotations

import torch


def lora_ref(
    x: torch.Tensor,  # [T, in]
    y: torch.Tensor,  # [T, out]: the base projection
    a: torch.Tensor,  # [slots, num_slices * R, in]
    b: torch.Tensor,  # [slots, out, R]
    scalings: torch.Tensor,  # [slots] float
    ranks: torch.Tensor,  # [slots] int
    token_slots: torch.Tensor,  # [T] int: each token's slot, negative: the base model
    slice_starts: tuple[int, ...] = (0,),
) -> torch.Tensor:  # [T, out] in y's dtype: a new tensor
    """y + scaling * (x @ A_i^T) @ B_i^T per output slice i of each token's adapter, one adapter
    at a time over its tokens, float32 throughout, rounded once."""
    out_dim = y.shape[-1]
    max_rank = b.shape[-1]
    bounds = [*slice_starts, out_dim]
    out = y.float().clone()
    x32 = x.float()
    slots = token_slots.long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rank = int(ranks[slot])
        tokens = torch.nonzero(slots == slot, as_tuple=True)[0]
        for i in range(len(slice_starts)):
            a_i = a[slot, i * max_rank : i * max_rank + rank].float()  # [rank, in]
            b_i = b[slot, bounds[i] : bounds[i + 1], :rank].float()  # [w_i, rank]
            delta = (x32[tokens] @ a_i.t()) @ b_i.t() * float(scalings[slot])
            out[tokens, bounds[i] : bounds[i + 1]] += delta
    return out.to(y.dtype)
