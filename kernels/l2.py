"""L2 prefetch hints: a latency-bound kernel's programs pull the next kernel's bytes into the L2."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class L2Prefetch(NamedTuple):
    """Bytes a kernel asks the L2 to hold for the kernel after it (its weight, say): the first
    `fraction` of data's bytes."""

    data: torch.Tensor  # contiguous; its bytes from the first element on
    fraction: float = 1.0

    def base(self) -> torch.Tensor:
        """data's first `fraction` of bytes, as uint8."""
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"L2Prefetch.fraction must be in (0, 1], got {self.fraction}")
        assert self.data.is_contiguous(), "L2Prefetch: data must be contiguous"
        raw = self.data.view(-1).view(torch.uint8)
        return raw[: max(1, int(raw.numel() * self.fraction))]


@triton.jit
def prefetch_l2_part(Base, nbytes, part, parts, LINES: tl.constexpr):  # type: ignore[no-untyped-def]
    """Ask the L2 for part `part` of `parts` of Base[0:nbytes] (a uint8 pointer): whole 128-byte
    lines, LINES per step, kept with evict_last. Fire and forget: nothing waits for the lines,
    and no register holds them (CUDA only: inline PTX)."""
    per = tl.cdiv(tl.cdiv(nbytes, 128), parts) * 128
    lo = part * per
    hi = tl.minimum(lo + per, nbytes)
    for off in range(lo, hi, LINES * 128):
        offs = tl.minimum(off + tl.arange(0, LINES).to(tl.int64) * 128, hi - 1)
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [Base + offs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
