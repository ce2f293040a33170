"""Paged-KV page lists from the request-to-token table (the `indices` FlashInfer's wrappers read)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, check_tensor


@triton.jit
def _kv_page_indices_kernel(  # type: ignore[no-untyped-def]
    Req_to_token,  # [max_reqs, max_context] int
    Req_rows,  # [B] int
    Indptr,  # [B + 1] int32: request b's pages go to Out[Indptr[b]:Indptr[b + 1]]
    Out,  # [>= Indptr[B]] int32
    stride_rr,
    page_size,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(Req_rows + b).to(tl.int64)
    start = tl.load(Indptr + b)
    n = tl.load(Indptr + b + 1) - start
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < n
        # page j of the request holds positions [j * page_size, (j + 1) * page_size)
        slot = tl.load(Req_to_token + row * stride_rr + j.to(tl.int64) * page_size, mask=m)
        tl.store(Out + start + j, (slot // page_size).to(tl.int32), mask=m)


def kv_page_indices(
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_rows: torch.Tensor,  # [B] int
    indptr: torch.Tensor,  # [B + 1] int32, on the device
    out: torch.Tensor,  # [>= total pages] int32, written at [0, indptr[B])
    page_size: int,
) -> torch.Tensor:
    """The page of each request's positions 0, P, 2P, ...: out[indptr[b] + j] =
    req_to_token[req_rows[b], j * P] // P. No host sync (the page counts stay on the device)."""
    bsz = req_rows.shape[0]
    dev = req_to_token.device
    check_tensor(req_to_token, "req_to_token", (None, None), INDEX_DTYPES, dev)
    check_tensor(req_rows, "req_rows", (bsz,), INDEX_DTYPES, dev)
    check_tensor(indptr, "indptr", (bsz + 1,), (torch.int32,), dev)
    check_tensor(out, "out", (None,), (torch.int32,), dev)
    assert page_size >= 1, page_size
    if bsz:
        _kv_page_indices_kernel[(bsz,)](
            req_to_token, req_rows, indptr, out, req_to_token.stride(0), page_size, BLOCK=128
        )
    return out
