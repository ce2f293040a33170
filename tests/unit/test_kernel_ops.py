"""RMSNorm (QK-norm per head too), SiLU-and-mul, argmax and rotary on CPU under TRITON_INTERPRET=1 against the float32
references."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close, make_pool

FP8 = torch.float8_e4m3fn

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


NORM_CASES = [(64, torch.float32), (96, torch.float16), (1000, torch.bfloat16)]


@pytest.mark.parametrize("hidden, dtype", NORM_CASES)
@interpreted
def test_rmsnorm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden + 8).to(dtype)[:, 4 : 4 + hidden]  # a row stride past the width
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = torch.full((7, hidden), NAN, dtype=dtype)
    wk.rmsnorm(x, weight, 1e-6, out=out)
    assert_close(out, ref.rmsnorm_ref(x, weight, 1e-6), TOL[dtype] * 3)


@pytest.mark.parametrize("hidden, dtype", NORM_CASES)
@interpreted
def test_fused_add_rmsnorm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden).to(dtype)
    residual = torch.randn(7, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x_want, res_want = ref.fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    wk.fused_add_rmsnorm(x, residual, weight, 1e-5)
    assert_close(residual, res_want, TOL[dtype])
    assert_close(x, x_want, TOL[dtype] * 3)
    # x is the norm of the sum as stored (rounded to the dtype), not of the float32 sum
    assert_close(x, ref.rmsnorm_ref(residual, weight, 1e-5), TOL[dtype])


@pytest.mark.parametrize(
    "dim, dtype", [(128, torch.float32), (96, torch.float16), (64, torch.bfloat16)]
)
@interpreted
def test_heads_rmsnorm_normalises_q_and_k_in_place_as_rmsnorm_per_row(
    dim: int, dtype: torch.dtype
) -> None:
    """Qwen3's QK-norm over the q and k views of a fused QKV output (strided rows), v untouched:
    each head vector exactly as rmsnorm of the copied rows."""
    tokens, q_heads, kv_heads = 3, 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim)
    wq, wk_ = (1 + 0.1 * torch.randn(dim)).to(dtype), (1 + 0.1 * torch.randn(dim)).to(dtype)
    want_q = wk.rmsnorm(q.reshape(-1, dim), wq, 1e-6).view(q.shape)
    want_k = wk.rmsnorm(k.reshape(-1, dim), wk_, 1e-6).view(k.shape)
    v_before = v.clone()
    got_q, got_k = wk.heads_rmsnorm_(q, k, wq, wk_, 1e-6)
    assert got_q.data_ptr() == qkv.data_ptr() and torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k) and torch.equal(v, v_before)


@pytest.mark.parametrize("inter, dtype", [(64, torch.float32), (1500, torch.bfloat16)])
@interpreted
def test_silu_and_mul(inter: int, dtype: torch.dtype) -> None:
    gate_up = (2 * torch.randn(5, 2 * inter)).to(dtype)
    out = torch.full((5, inter), NAN, dtype=dtype)
    wk.silu_and_mul(gate_up, out=out)
    assert_close(out, ref.silu_and_mul_ref(gate_up), TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 2047, 2048, 5000, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@interpreted
def test_argmax_rows(vocab: int, dtype: torch.dtype) -> None:
    x = torch.randn(4, vocab + 3).to(dtype)[:, :vocab]  # a row stride wider than the row
    x[1] = x[1].round()  # many equal maxima: the first one counts
    x[2] = float("-inf")  # nothing but -inf: index 0, as torch gives
    x[3, vocab // 2] = float("inf")
    x[3, vocab - 1] = NAN  # a NaN wins over +inf (torch.argmax)
    out = torch.full((4,), -7, dtype=torch.int64)
    wk.argmax_rows(x, out=out)
    assert out.tolist() == x.float().argmax(-1).tolist()
    assert wk.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="1 to"):
        wk.argmax_rows(x[:, :0])


ROPE_CASES = [
    (64, 64, True, torch.float32),
    (128, 128, False, torch.float16),
    (64, 32, True, torch.bfloat16),
]


@pytest.mark.parametrize("dim, rot, neox, dtype", ROPE_CASES)
@interpreted
def test_rotary_embedding(dim: int, rot: int, neox: bool, dtype: torch.dtype) -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    cache = wk.cos_sin_cache(inv_freq, 300)
    positions = torch.randint(0, 300, (6,))
    qk = torch.randn(6, 10 * dim).to(dtype)  # q and k as views into one fused projection
    q, k = qk[:, : 8 * dim].view(6, 8, dim), qk[:, 8 * dim :].view(6, 2, dim)
    q_want, k_want = ref.rotary_embedding_ref(positions, q, k, cache, is_neox=neox)
    wk.rotary_embedding(positions, q, k, cache, is_neox=neox)
    assert_close(q, q_want, TOL[dtype])
    assert_close(k, k_want, TOL[dtype])


@pytest.mark.parametrize(
    "neox, dtype, pool_dtype",
    [(True, torch.float32, torch.float32), (False, torch.float16, torch.float16),
     (True, torch.float32, FP8)],
)  # fmt: skip
@interpreted
def test_rotary_stores_k_and_v_as_store_kv_does(
    neox: bool, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """rotary_embedding(kv_store=...) leaves q, k and the pool exactly as rotary_embedding then
    store_kv do (an fp8 pool saturated), and writes no slot outside loc."""
    dim, hkv, tokens, slots = 64, 2, 7, 30
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    cache = wk.cos_sin_cache(inv_freq, 300)
    positions = torch.randint(0, 300, (tokens,))
    qkv = (torch.randn(tokens, 12 * dim) * 3).to(dtype)  # q, k, v as views of one projection
    qkv[0, 8 * dim : 8 * dim + 4] = torch.tensor([1000.0, -1000.0, 3e4, -500.0])  # past fp8 max
    qkv[3, 11 * dim] = 700.0
    loc = torch.randperm(slots)[:tokens]
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q, k = x[:, : 8 * dim].view(tokens, 8, dim), x[:, 8 * dim : 10 * dim].view(tokens, hkv, dim)
        v = x[:, 10 * dim :].view(tokens, hkv, dim)
        k_buf = torch.full((slots, hkv, dim), NAN).to(pool_dtype)
        v_buf = torch.full((slots, hkv, dim), NAN).to(pool_dtype)
        if fused:
            wk.rotary_embedding(
                positions, q, k, cache, is_neox=neox, kv_store=(v, k_buf, v_buf, loc)
            )
        else:
            wk.rotary_embedding(positions, q, k, cache, is_neox=neox)
            wk.store_kv(k, v, k_buf, v_buf, loc)
        outs.append((x, k_buf.float(), v_buf.float()))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got.isnan(), want.isnan()), "a slot outside loc was written"
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if pool_dtype == FP8:  # v[3] head 1 dim 0 was 700: saturated, not NaN
        assert outs[1][2][loc[3], 1, 0].item() == 448.0


@interpreted
def test_rotary_store_needs_the_whole_head_rotated() -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    cache = wk.cos_sin_cache(inv_freq, 10)
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    bufs = (v, torch.zeros(4, 2, 64), torch.zeros(4, 2, 64), torch.arange(2))
    with pytest.raises(ValueError, match="kv_store needs the rotary dim 32 = 64"):
        wk.rotary_embedding(torch.arange(2), q, k, cache, kv_store=bufs)


@interpreted
def test_rotary_matches_runtime_llama31() -> None:
    """The kernel with a cache built from the runtime's Llama 3.1 inv_freq equals its module."""
    from weft.runtime.models.layers import RotaryEmbedding, rope_inv_freq

    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    module = RotaryEmbedding(64, 20000, params)
    positions = torch.tensor([0, 1, 77, 4096, 9000, 19999])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    q_want, k_want = module(positions, q, k)
    wk.rotary_embedding(positions, q, k, wk.cos_sin_cache(rope_inv_freq(64, params), 20000))
    assert_close(q, q_want, 1e-5)
    assert_close(k, k_want, 1e-5)


@pytest.mark.parametrize(
    "vocab, width, rows, dtype",
    [
        (100, 4, None, torch.float32),
        (77, 2, [3, 0], torch.bfloat16),
        (3000, 94, [1], torch.float16),
    ],
)
@interpreted
def test_apply_token_bitmask(
    vocab: int, width: int, rows: list[int] | None, dtype: torch.dtype
) -> None:
    logits = torch.randn(4, vocab).to(dtype)
    num_masks = 4 if rows is None else len(rows)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_masks, width), dtype=torch.int32)
    row_t = None if rows is None else torch.tensor(rows)
    want = ref.apply_token_bitmask_ref(logits, bitmask, row_t)
    wk.apply_token_bitmask(logits, bitmask, row_t)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@interpreted
def test_kv_page_indices(page: int, index_dtype: torch.dtype) -> None:
    lens = [1, 17, 300, 5, 64]  # 300 tokens of page 1: more pages than one block of the kernel
    pool = make_pool(lens, lens, page, 1, 4, torch.float32)
    num_pages = [-(-n // page) for n in lens]
    indptr = torch.tensor([0, *num_pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = int(indptr[-1])
    out = torch.full((total + 3,), -7, dtype=torch.int32)  # poisoned, and 3 past the end
    table, rows = pool.req_to_token.to(index_dtype), pool.req_rows.to(index_dtype)
    wk.kv_page_indices(table, rows, indptr, out, page)
    expected = ref.kv_page_indices_ref(pool.req_to_token, pool.req_rows, num_pages, page)
    assert torch.equal(out[:total], expected)
    assert (out[total:] == -7).all(), "wrote past the last page"
