"""Row-wise argmax over the vocabulary (greedy sampling): chunks of a row in parallel, then a merge.

torch's argmax gives a row of 128k logits to few blocks: 33-36 us per step on the H200 at batch 1
to 64, 0.7% of a batch-1 decode step (`benchmarks/kernel.py elementwise`). Here each row is
split into CHUNK-wide programs, and a second kernel merges their (max, index) pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOATS, check_tensor

CHUNK = 2048
NO_NAN = 2**31 - 1  # a chunk's first-NaN index when it has none


@triton.jit
def _argmax_chunk_kernel(  # type: ignore[no-untyped-def]
    X,  # [B, V]
    Part_v,  # [B, C] float32: each chunk's max (NaN aside)
    Part_i,  # [B, C] int32: its first index
    Part_nan,  # [B, C] int32: the chunk's first NaN index, or NO_NAN
    vocab,
    stride_x,
    num_chunks,
    CHUNK: tl.constexpr,
    NO_NAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    nan = x != x
    v, i = tl.max(tl.where(nan, float("-inf"), x), 0, return_indices=True,
                  return_indices_tie_break_left=True)  # fmt: skip
    first_nan = tl.min(tl.where(nan, offs, NO_NAN), 0)
    out = row * num_chunks + c
    tl.store(Part_v + out, v)
    tl.store(Part_i + out, c * CHUNK + i)
    tl.store(Part_nan + out, first_nan)


@triton.jit
def _argmax_merge_kernel(  # type: ignore[no-untyped-def]
    Part_v,
    Part_i,
    Part_nan,
    Out,  # [B] int64
    num_chunks,
    BLOCK_C: tl.constexpr,
    NO_NAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    v = tl.load(Part_v + row * num_chunks + offs, mask=mask, other=float("-inf"))
    # the first chunk holding the max holds the row's first max (chunks are in index order)
    _, best = tl.max(v, 0, return_indices=True, return_indices_tie_break_left=True)
    idx = tl.load(Part_i + row * num_chunks + best)
    first_nan = tl.min(tl.load(Part_nan + row * num_chunks + offs, mask=mask, other=NO_NAN), 0)
    tl.store(Out + row, tl.where(first_nan < NO_NAN, first_nan, idx).to(tl.int64))


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [B]: the index of each row's maximum in x [B, V], as torch.argmax(x, -1) gives it
    (the first of equal maxima; a row with NaN gives its first NaN). Returns out."""
    check_tensor(x, "x", (None, None), FLOATS)
    bsz, vocab = x.shape
    if vocab == 0 or vocab >= NO_NAN:
        raise ValueError(f"argmax_rows: a row must have 1 to {NO_NAN - 1} entries, got {vocab}")
    if out is None:
        out = torch.empty(bsz, dtype=torch.int64, device=x.device)
    check_tensor(out, "out", (bsz,), (torch.int64,), x.device)
    if bsz == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    part_v = torch.empty(bsz, chunks, dtype=torch.float32, device=x.device)
    part_i = torch.empty(bsz, chunks, dtype=torch.int32, device=x.device)
    part_nan = torch.empty(bsz, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(bsz, chunks)](
        x, part_v, part_i, part_nan, vocab, x.stride(0), chunks, CHUNK=CHUNK, NO_NAN=NO_NAN,
        num_warps=4,
    )  # fmt: skip
    _argmax_merge_kernel[(bsz,)](
        part_v, part_i, part_nan, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
        NO_NAN=NO_NAN, num_warps=4 if chunks <= 1024 else 8,
    )  # fmt: skip
    return out
