"""L2 prefetch of a tensor's leading bytes (sm_90 bulk prefetch): the loads start now, nobody waits.

A decode step at small batch streams every weight once, but between the projection GEMMs run
kernels that read little (norms, rotary, attention over a short context): HBM idles while they
run. Launched on a side stream during such a window, `l2_prefetch` asks the L2 for the next
projection's weight, so the GEMM then reads it from L2. Each thread issues one
`cp.async.bulk.prefetch.L2` of `chunk` bytes and the kernel ends: the copies run in the memory
system, not in the kernel. It is a hint: correctness never depends on it, only speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN = 16  # the bulk prefetch wants 16-byte aligned addresses and sizes
PER_PROGRAM = 32  # one warp: one prefetch per thread
DEFAULT_CHUNK = 16384


# One bulk prefetch per thread ($1: address, $2: bytes; none when $2 <= 0); $0 is a dummy result.
# The first marks the lines evict-last (the GEMM reads them once, soon), the second as usual.
PREFETCH_EVICT_LAST = """{
    .reg .pred p;
    .reg .b64 pol;
    setp.gt.s32 p, $2, 0;
    createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
    @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
    mov.b32 $0, 0;
}"""
PREFETCH_NORMAL = """{
    .reg .pred p;
    setp.gt.s32 p, $2, 0;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.b32 $0, 0;
}"""


@triton.jit
def _l2_prefetch_kernel(  # type: ignore[no-untyped-def]
    Base,  # *u8
    nbytes,  # a multiple of 16
    CHUNK: tl.constexpr,
    PER_PROGRAM: tl.constexpr,
    ASM: tl.constexpr,  # PREFETCH_EVICT_LAST or PREFETCH_NORMAL
):
    offs = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        ASM, "=r,l,r", [Base + offs, size], dtype=tl.int32, is_pure=False, pack=1
    )


def supports_l2_prefetch(device: torch.device) -> bool:
    """Whether `l2_prefetch` can run on `device`: a CUDA GPU of compute capability 9.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch(
    t: torch.Tensor,
    nbytes: int | None = None,
    *,
    chunk: int = DEFAULT_CHUNK,
    evict_last: bool = True,
) -> None:
    """Start moving the first `nbytes` (all by default, rounded down to 16) of contiguous `t`
    into the L2. Returns at once; the launch goes to the current stream."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: the tensor must be contiguous")
    if not supports_l2_prefetch(t.device):
        raise ValueError(f"l2_prefetch needs a CUDA GPU of compute capability 9.0+, got {t.device}")
    if chunk < ALIGN or chunk % ALIGN:
        raise ValueError(f"l2_prefetch: chunk must be a positive multiple of {ALIGN}, got {chunk}")
    if t.data_ptr() % ALIGN:
        raise ValueError("l2_prefetch: the tensor's data must be 16-byte aligned")
    total = t.numel() * t.element_size()
    if nbytes is None:
        nbytes = total
    if not 0 <= nbytes <= total:
        raise ValueError(f"l2_prefetch: nbytes {nbytes} outside the tensor's 0..{total} bytes")
    nbytes -= nbytes % ALIGN
    if nbytes == 0:
        return
    grid = (triton.cdiv(nbytes, chunk * PER_PROGRAM),)
    _l2_prefetch_kernel[grid](
        t.view(-1).view(torch.uint8), nbytes, CHUNK=chunk, PER_PROGRAM=PER_PROGRAM,
        ASM=PREFETCH_EVICT_LAST if evict_last else PREFETCH_NORMAL, num_warps=1,
    )  # fmt: skip
