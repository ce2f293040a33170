"""The extend (prefill) attention, the KV store and fp8 pools on CPU under TRITON_INTERPRET=1
against the float32 references."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close, make_pool

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


EXTEND_CASES = [
    # heads, kv heads, head dim, page size, dtype, prefix lens, extend lens, block_m, block_n
    (4, 4, 64, 1, torch.float32, [0, 0, 0], [1, 20, 37], 16, 16),
    (8, 2, 128, 16, torch.float16, [16, 0, 45], [30, 1, 17], 16, 16),
    (8, 1, 64, 16, torch.float32, [100, 3, 0], [1, 1, 2], 16, 16),
    (8, 2, 64, 1, torch.float32, [7, 33, 5], [40, 3, 0], 32, 16),
    (4, 1, 128, 16, torch.float16, [70], [70], None, None),  # default block sizes
    (8, 1, 64, 16, torch.float16, [0, 21, 16, 40], [0, 1, 33, 18], 32, 16),
    (6, 2, 64, 16, torch.float32, [9, 0, 20], [13, 5, 1], 16, 16),  # G = 3: 5 tokens x 3 + 1 row
]


def extend_args(
    heads: int, hkv: int, dim: int, page: int, dtype: torch.dtype, prefix: list[int], ext: list[int]
) -> tuple[Any, ...]:
    """extend_attention's inputs up to `out`: random q/k/v for the new tokens, a pool holding the
    prefixes (the new tokens' pool slots stay NaN: their K/V must come from k/v, not the pool)."""
    lens = [max(p + e, 1) for p, e in zip(prefix, ext, strict=True)]
    pool = make_pool(lens, prefix, page, hkv, dim, dtype)
    tokens = sum(ext)
    q = torch.randn(tokens, heads, dim).to(dtype)
    k = torch.randn(tokens, hkv, dim).to(dtype)
    v = torch.randn(tokens, hkv, dim).to(dtype)
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    return (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, *lens_args)


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize(
    "heads, hkv, dim, page, dtype, prefix, ext, block_m, block_n", EXTEND_CASES
)
@interpreted
def test_extend_attention(
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    dtype: torch.dtype,
    prefix: list[int],
    ext: list[int],
    block_m: int | None,
    block_n: int | None,
    pack_gqa: bool,
) -> None:
    """Packed (a kv head's q heads in one program, rows = token x head) and one program per q
    head; G = 1 packed is one head per program."""
    args = extend_args(heads, hkv, dim, page, dtype, prefix, ext)
    out = torch.full(args[0].shape, NAN, dtype=dtype)
    launch = {"block_m": block_m, "block_n": block_n, "pack_gqa": pack_gqa}
    wk.extend_attention(*args, out, dim**-0.5, max(ext), **launch)
    assert_close(out, ref.extend_attention_ref(*args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("pack_gqa, dtype", [(False, torch.float32), (True, torch.float16)])
@interpreted
def test_extend_attention_runs_a_work_list(pack_gqa: bool, dtype: torch.dtype) -> None:
    """With `work` (extend_work's query blocks, heaviest first; requests of 0 new tokens give
    none), the programs run just those blocks: the reference's output, every row written; the
    same in another order."""
    heads, hkv, dim, page = 8, 2, 32, 4
    prefix, ext = [20, 0, 9, 33, 5], [5, 40, 0, 1, 17]
    args = extend_args(heads, hkv, dim, page, dtype, prefix, ext)
    expected = ref.extend_attention_ref(*args, dim**-0.5)
    block_m = 16
    block_t = wk.extend_block_tokens(dtype, dtype, dim, heads // hkv, pack_gqa, block_m)
    assert block_t == (16 // 4 if pack_gqa else 16)
    items = wk.extend_work(ext, prefix, block_t)
    pairs = list(zip(items[::2], items[1::2], strict=True))
    assert sorted(pairs) == [(b, m) for b, n in enumerate(ext) for m in range(-(-n // block_t))]
    keys = [prefix[b] + min(ext[b], (m + 1) * block_t) for b, m in pairs]
    assert keys == sorted(keys, reverse=True)  # the longest walks first
    for order in (items, [x for pair in reversed(pairs) for x in pair]):
        work = torch.tensor(order, dtype=torch.int32).view(-1, 2)
        out = torch.full(args[0].shape, NAN, dtype=dtype)
        wk.extend_attention(*args, out, dim**-0.5, block_m=block_m, pack_gqa=pack_gqa, work=work)
        assert_close(out, expected, TOL[dtype])


@interpreted
def test_extend_attention_packs_heads_only_where_they_fit() -> None:
    """32 q heads on one kv head: 16-row blocks run one program per q head (pack_gqa=True is
    refused there); 32-row blocks can pack them, one new token per program."""
    prefix, ext = [5, 17, 0], [2, 0, 3]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    pool = make_pool(lens, prefix, 16, 1, 32, torch.float32)
    q, k, v = (torch.randn(5, h, 32) for h in (32, 1, 1))
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    args = (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, *lens_args)
    expected = ref.extend_attention_ref(*args, 0.2)
    for block_m, pack in ((16, False), (32, True)):
        out = torch.full_like(q, NAN)
        wk.extend_attention(*args, out, 0.2, max(ext), block_m=block_m, block_n=16, pack_gqa=pack)
        assert_close(out, expected, 1e-5)
    with pytest.raises(AssertionError, match="cannot pack"):
        wk.extend_attention(*args, out, 0.2, 3, block_m=16, pack_gqa=True)


@pytest.mark.parametrize(
    "hkv, dim, src, dst",
    [(2, 64, torch.float32, torch.float32), (3, 128, torch.float32, torch.float16)],
)
@interpreted
def test_store_kv(hkv: int, dim: int, src: torch.dtype, dst: torch.dtype) -> None:
    tokens, num_slots = 9, 40
    qkv = torch.randn(tokens, (4 + 2 * hkv) * dim).to(src)  # k, v as views into a fused output
    k = qkv[:, 4 * dim : (4 + hkv) * dim].view(tokens, hkv, dim)
    v = qkv[:, (4 + hkv) * dim :].view(tokens, hkv, dim)
    k_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dst)
    v_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dst)
    loc = torch.randperm(num_slots)[:tokens]
    k_want, v_want = k_buffer.clone(), v_buffer.clone()
    ref.store_kv_ref(k, v, k_want, v_want, loc)
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    for got, want in ((k_buffer, k_want), (v_buffer, v_want)):
        assert torch.equal(got.isnan(), want.isnan()), "a slot outside loc was written"
        assert torch.equal(got[loc], want[loc])


FP8 = torch.float8_e4m3fn


def store_new_tokens(
    pool: Any, prefix: list[int], ext: list[int], k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """k/v into the new tokens' slots (after each prefix) as the backends store them before
    attention; returns the slots. (torch's e4m3 rounding: the interpreter's cast is not the GPU's.)"""
    loc = torch.cat([pool.req_to_token[pool.req_rows[b], p : p + e]
                     for b, (p, e) in enumerate(zip(prefix, ext, strict=True))])  # fmt: skip
    ref.store_kv_ref(k, v, pool.k_buffer, pool.v_buffer, loc)
    return loc


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@interpreted
def test_attention_reads_an_fp8_pool(q_dtype: torch.dtype) -> None:
    """kv_cache_dtype fp8_e4m3: decode and extend read the fp8 pool upcast to the queries' dtype
    (the references upcast the same bytes), extend's new tokens too, stored there first; unowned
    slots stay NaN, so stray reads still show. (Under a bfloat16 q all dots over an fp8 pool run
    in float16: the interpreter's bfloat16 dots are wrong, these are not.)"""
    lens = [5, 40, 17]
    pool = make_pool(lens, lens, 16, 2, 64, FP8)
    q = torch.randn(3, 8, 64).to(q_dtype)
    out = torch.full((3, 8, 64), NAN, dtype=q_dtype)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    wk.decode_attention(q, *args, out, 0.125, wk.DecodePlan(2, block_n=16))
    assert_close(out, ref.decode_attention_ref(q, *args, 0.125), TOL[q_dtype])
    prefix, ext = [16, 0, 30], [3, 5, 1]
    pool = make_pool([p + e for p, e in zip(prefix, ext, strict=True)], prefix, 16, 2, 64, FP8)
    tokens = sum(ext)
    q, k, v = (torch.randn(tokens, h, 64).to(q_dtype) for h in (8, 2, 2))
    store_new_tokens(pool, prefix, ext, k, v)
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    ext_args = (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows)
    expected = ref.extend_attention_ref(*ext_args, *lens_args, 0.125)
    for pack_gqa in (True, False):
        out = torch.full((tokens, 8, 64), NAN, dtype=q_dtype)
        launch = {"block_m": 16, "block_n": 16, "pack_gqa": pack_gqa}
        wk.extend_attention(*ext_args, *lens_args, out, 0.125, max(ext), **launch)
        assert_close(out, expected, TOL[q_dtype])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@interpreted
def test_extend_over_an_fp8_pool_attends_to_the_stored_new_tokens(q_dtype: torch.dtype) -> None:
    """Issue 40: over an fp8 pool the new tokens' K/V are read back from the pool (quantized, as
    the decode kernel and the torch backend read them), not taken fresh from k/v, so a token's
    attention does not depend on which step computed it. Page size 1, a request with no prefix
    (a first prefill chunk reads nothing else from the pool), one over a prefix, a 1-token one."""
    prefix, ext = [0, 16, 7], [21, 3, 1]
    pool = make_pool([p + e for p, e in zip(prefix, ext, strict=True)], prefix, 1, 2, 64, FP8)
    tokens = sum(ext)
    q, k, v = (torch.randn(tokens, h, 64).to(q_dtype) for h in (8, 2, 2))
    loc = store_new_tokens(pool, prefix, ext, k, v)
    ext_t = torch.tensor(ext)
    meta = (pool.req_to_token, pool.req_rows, torch.tensor(prefix), ext_t,
            torch.cumsum(ext_t, 0) - ext_t)  # fmt: skip
    # the same attention over float32 copies: the pool's upcast values, or k/v as they came
    upcast = (pool.k_buffer.float(), pool.v_buffer.float())
    stored = (pool.k_buffer[loc].float(), pool.v_buffer[loc].float())
    expected = ref.extend_attention_ref(q, *stored, *upcast, *meta, 0.125)
    fresh = ref.extend_attention_ref(q, k.float(), v.float(), *upcast, *meta, 0.125)
    gap = ((fresh - expected).norm() / expected.norm()).item()
    assert gap > 5 * TOL[q_dtype], f"the two readings differ by only {gap:.3g}"
    args = (q, k, v, pool.k_buffer, pool.v_buffer, *meta)
    assert_close(ref.extend_attention_ref(*args, 0.125), expected, 1e-6)  # the fp8 reference
    for pack_gqa in (True, False):
        out = torch.full((tokens, 8, 64), NAN, dtype=q_dtype)
        launch = {"block_m": 16, "block_n": 16, "pack_gqa": pack_gqa}
        wk.extend_attention(*args, out, 0.125, max(ext), **launch)
        assert_close(out, expected, TOL[q_dtype])


@interpreted
def test_fp8_v_staging_is_cuda_only() -> None:
    """The staged V conversion is inline PTX: asked for off CUDA (or on a 16-bit pool), a
    ValueError that says what it needs."""
    lens = [5, 9]
    pool = make_pool(lens, lens, 16, 2, 64, FP8)
    q = torch.randn(2, 8, 64, dtype=torch.float16)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    with pytest.raises(ValueError, match="fp8_v_staged needs an fp8 pool, a 16-bit q, CUDA"):
        wk.decode_attention(
            q, *args, torch.empty_like(q), 0.125, wk.DecodePlan(2, fp8_v_staged=True)
        )


@interpreted
def test_store_kv_into_an_fp8_pool_saturates() -> None:
    """Values past e4m3's largest finite value (448) are stored as +-448, never NaN. (The inputs are
    fp8-representable after clamping: the interpreter's fp32 -> fp8 rounding is not the GPU's.)"""
    k = torch.randn(6, 2, 32).to(FP8).float()
    v = torch.randn(6, 2, 32).to(FP8).float()
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -3e4])
    v[5, 1, :2] = torch.tensor([float("inf"), -512.0])
    k_buffer, v_buffer = (
        torch.full((20, 2, 32), NAN, dtype=FP8),
        torch.full((20, 2, 32), NAN, dtype=FP8),
    )
    loc = torch.randperm(20)[:6]
    k_want, v_want = k_buffer.clone(), v_buffer.clone()
    ref.store_kv_ref(k, v, k_want, v_want, loc)
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    for got, want in ((k_buffer, k_want), (v_buffer, v_want)):
        assert not got[loc].float().isnan().any()
        assert torch.equal(got.float().isnan(), want.float().isnan())
        assert torch.equal(got[loc].float(), want[loc].float())
    assert k_buffer[loc[0], 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
