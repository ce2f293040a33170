"""Host-to-device copies that do not wait for the device: pinned staging and non-blocking copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A device tensor of `values`. On CUDA the values go through pinned memory and a non-blocking
    copy, so the call returns without waiting for the kernels queued before it (a plain
    `torch.tensor(values, device="cuda")` waits for them: overlap scheduling needs it not to).
    PyTorch's pinned-memory cache keeps the staging block until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)
