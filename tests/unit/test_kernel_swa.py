"""Sliding-window attention (SWA) in the Triton decode and extend kernels on CPU under
TRITON_INTERPRET=1: against the float32 references (with the keys before each window poisoned
with NaN, so a read that is masked instead of skipped shows), and the triton backend against the
torch backend with the same window (eager, mixed, rotating, shared-prefix and graph-style steps)."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from kv_helpers import step_batch
from test_kernel_extend import FP8, extend_args, store_new_tokens
from test_kernels import INTERPRETING, NAN, TOL, assert_close, make_pool

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


def poison_before(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    firsts: list[int],
) -> None:
    """NaN into request b's K/V at positions [0, firsts[b]): no walk may read them."""
    for b, first in enumerate(firsts):
        slots = table[rows[b], : max(first, 0)].long()
        k_buffer[slots] = NAN
        v_buffer[slots] = NAN


DECODE_CASES = [
    # heads, kv heads, head dim, page size, splits, dtype, seq lens, window, block_n
    (4, 1, 64, 1, 1, torch.float32, [1, 17, 40], 8, 16),  # one split: no merge
    (8, 2, 64, 16, 4, torch.float16, [5, 33, 70], 20, 16),  # merged by the last split
    (4, 1, 64, 16, 3, torch.float32, [64, 1, 100, 49], 64, 16),  # = one length, > others
    (8, 2, 32, 16, 33, torch.float16, [300, 5, 64], 37, 16),  # > MERGE_MAX_SPLITS: the reduce
    (4, 4, 32, 1, 2, torch.float32, [10, 3, 0], 1, 16),  # window 1; a padded row (seq_len 0)
    (4, 1, 64, 16, 2, torch.float32, [30, 7], 1000, None),  # larger than every context
]


@pytest.mark.parametrize(
    "heads, hkv, dim, page, splits, dtype, lens, window, block_n", DECODE_CASES
)
@interpreted
def test_decode_attention_in_a_window(
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    splits: int,
    dtype: torch.dtype,
    lens: list[int],
    window: int,
    block_n: int | None,
) -> None:
    """Each query reads its last min(window, seq_len) keys: the reference's output, with every
    key before the window NaN (never read); a padded row gives zeros."""
    pool = make_pool([max(n, 1) for n in lens], lens, page, hkv, dim, dtype)
    bsz = len(lens)
    q = torch.randn(bsz, heads, dim).to(dtype)
    seq_lens = torch.tensor(lens)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, seq_lens)
    live = [b for b, n in enumerate(lens) if n > 0]
    live_args = (*args[:3], pool.req_rows[live], seq_lens[live])
    expected = ref.decode_attention_ref(q[live], *live_args, dim**-0.5, window)
    if window < max(lens):
        full = ref.decode_attention_ref(q[live], *live_args, dim**-0.5)
        assert not torch.allclose(full, expected), "the window changes nothing here"
    poison_before(*args[:4], [n - window for n in lens])
    out = torch.full((bsz, heads, dim), NAN, dtype=dtype)
    plan = wk.DecodePlan(splits, block_n=block_n, window=window)
    wk.decode_attention(q, *args, out, dim**-0.5, plan)
    assert_close(out[live], expected, TOL[dtype])
    assert not out[[b for b in range(bsz) if b not in live]].any()


@interpreted
def test_decode_window_larger_than_the_context_is_no_window() -> None:
    lens = [9, 40, 17]
    pool = make_pool(lens, lens, 16, 2, 32, torch.float32)
    q = torch.randn(3, 8, 32)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    outs = []
    for window in (None, 40, 41):
        out = torch.full_like(q, NAN)
        wk.decode_attention(q, *args, out, 0.2, wk.DecodePlan(2, block_n=16, window=window))
        outs.append(out)
    assert_close(outs[1], outs[0], 1e-6)
    assert_close(outs[2], outs[0], 1e-6)


@pytest.mark.parametrize("splits", [1, 4])
@interpreted
def test_decode_in_a_window_rotates_and_stores_the_new_token(splits: int) -> None:
    """rope + window: the split that ends at the new key (in every window) stores it first; the
    same output as rotary, store, then a windowed decode."""
    lens, dim, window = [37, 0, 130, 64], 32, 21
    pool = make_pool([max(n, 1) for n in lens], [max(n - 1, 0) for n in lens], 16, 2, dim,
                     torch.float32)  # fmt: skip
    seq_lens = torch.tensor(lens)
    positions = (seq_lens - 1).clamp(min=0)
    loc = pool.req_to_token[pool.req_rows, positions]
    cache = wk.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), 256)
    q, k, v = (torch.randn(4, h, dim) for h in (8, 2, 2))
    live = torch.tensor([0, 2, 3])
    poison_before(pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows,
                  [n - window for n in lens])  # fmt: skip
    k_pool, v_pool = pool.k_buffer.clone(), pool.v_buffer.clone()
    q_rot, k_rot = q.clone(), k.clone()
    wk.rotary_embedding(positions, q_rot, k_rot, cache)
    k_pool[loc[live]], v_pool[loc[live]] = k_rot[live], v[live]
    table = (pool.req_to_token, pool.req_rows, seq_lens)
    plan = wk.DecodePlan(splits, block_n=16, window=window)
    want = wk.decode_attention(q_rot, k_pool, v_pool, *table, torch.full_like(q, NAN), 0.125, plan)
    rope = wk.DecodeRope(positions, cache, k, v, loc)
    plan = wk.DecodePlan(splits, block_n=16, window=window, rope=rope)
    got = wk.decode_attention(q, pool.k_buffer, pool.v_buffer, *table, torch.full_like(q, NAN),
                              0.125, plan)  # fmt: skip
    assert_close(got[live], want[live], 1e-5)
    assert torch.equal(pool.k_buffer[loc[live]], k_pool[loc[live]])
    assert torch.equal(pool.v_buffer[loc[live]], v_pool[loc[live]])


@interpreted
def test_decode_plan_refuses_a_bad_window_or_one_with_a_shared_prefix() -> None:
    zeros = torch.zeros(1, dtype=torch.int32)
    shared = wk.SharedPrefix(torch.full((1, 16), -1, dtype=torch.int32), zeros, zeros, 1)
    with pytest.raises(ValueError, match="window must be None or >= 1"):
        wk.DecodePlan(2, window=0)
    with pytest.raises(ValueError, match="window cannot go with shared"):
        wk.DecodePlan(2, shared=shared, kv_starts=zeros, window=8)


EXTEND_CASES = [
    # heads, kv heads, head dim, page, dtype, prefix lens, extend lens, window, block_m, block_n
    (4, 4, 32, 1, torch.float32, [0, 0, 0], [1, 20, 37], 5, 16, 16),
    (8, 2, 64, 16, torch.float16, [16, 0, 45], [30, 1, 17], 20, 16, 16),
    (8, 1, 32, 16, torch.float32, [100, 3, 0], [1, 1, 2], 33, 16, 16),  # decode-like rows
    (8, 2, 32, 1, torch.float32, [7, 33, 5], [40, 3, 0], 16, 32, 16),  # = the query block
    (4, 1, 64, 16, torch.float16, [70], [70], 1000, None, None),  # larger; default tiles
    (6, 2, 32, 16, torch.float32, [9, 0, 20], [13, 5, 1], 1, 16, 16),  # window 1, G = 3
]


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize(
    "heads, hkv, dim, page, dtype, prefix, ext, window, block_m, block_n", EXTEND_CASES
)
@interpreted
def test_extend_attention_in_a_window(
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    dtype: torch.dtype,
    prefix: list[int],
    ext: list[int],
    window: int,
    block_m: int | None,
    block_n: int | None,
    pack_gqa: bool,
) -> None:
    """New token i sees keys at positions > prefix + i - window: the reference's output, with the
    prefix keys before the first new token's window NaN (no query block reads them)."""
    args = extend_args(heads, hkv, dim, page, dtype, prefix, ext)
    expected = ref.extend_attention_ref(*args, dim**-0.5, window)
    poison_before(*args[3:7], [p - window + 1 for p in prefix])
    out = torch.full(args[0].shape, NAN, dtype=dtype)
    launch = {"block_m": block_m, "block_n": block_n, "pack_gqa": pack_gqa}
    wk.extend_attention(*args, out, dim**-0.5, max(ext), window=window, **launch)
    assert_close(out, expected, TOL[dtype])


@interpreted
def test_extend_in_a_window_runs_a_work_list() -> None:
    heads, hkv, dim, page, window = 8, 2, 32, 4, 11
    prefix, ext = [20, 0, 9, 33, 5], [5, 40, 0, 1, 17]
    args = extend_args(heads, hkv, dim, page, torch.float32, prefix, ext)
    expected = ref.extend_attention_ref(*args, dim**-0.5, window)
    block_t = wk.extend_block_tokens(torch.float32, torch.float32, dim, heads // hkv, False, 16)
    work = torch.tensor(wk.extend_work(ext, prefix, block_t), dtype=torch.int32).view(-1, 2)
    out = torch.full(args[0].shape, NAN)
    wk.extend_attention(*args, out, dim**-0.5, block_m=16, work=work, window=window)
    assert_close(out, expected, 1e-5)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@interpreted
def test_windows_over_an_fp8_pool(q_dtype: torch.dtype) -> None:
    """kv_cache_dtype fp8_e4m3: decode and extend (its new tokens read back from the pool) in a
    window, against the references over the same fp8 bytes."""
    lens, window = [5, 40, 17], 13
    pool = make_pool(lens, lens, 16, 2, 64, FP8)
    q = torch.randn(3, 8, 64).to(q_dtype)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    expected = ref.decode_attention_ref(q, *args, 0.125, window)
    poison_before(*args[:4], [n - window for n in lens])
    out = torch.full((3, 8, 64), NAN, dtype=q_dtype)
    wk.decode_attention(q, *args, out, 0.125, wk.DecodePlan(2, block_n=16, window=window))
    assert_close(out, expected, TOL[q_dtype])
    prefix, ext = [16, 0, 30], [20, 5, 1]
    pool = make_pool([p + e for p, e in zip(prefix, ext, strict=True)], prefix, 16, 2, 64, FP8)
    tokens = sum(ext)
    q, k, v = (torch.randn(tokens, h, 64).to(q_dtype) for h in (8, 2, 2))
    store_new_tokens(pool, prefix, ext, k, v)
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    ext_args = (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows)
    expected = ref.extend_attention_ref(*ext_args, *lens_args, 0.125, window)
    poison_before(*ext_args[3:7], [p - window + 1 for p in prefix])
    for pack_gqa in (True, False):
        out = torch.full((tokens, 8, 64), NAN, dtype=q_dtype)
        launch = {"block_m": 16, "block_n": 16, "pack_gqa": pack_gqa}
        wk.extend_attention(*ext_args, *lens_args, out, 0.125, max(ext), window=window, **launch)
        assert_close(out, expected, TOL[q_dtype])


@interpreted
def test_triton_backend_in_a_window_equals_the_torch_backend() -> None:
    """TritonAttentionBackend with a layer's window = TorchAttentionBackend with it: a mixed step
    (two prefills over cached prefixes, three decodes), a rotating decode step, a decode step
    with a shared-prefix plan (a windowed layer walks alone; an unwindowed one still groups),
    eagerly and through graph-style prepare_graph / prepare_replay (padded rows read nothing).
    Windows below every context, at one (above others), and no window."""
    from weft.kernels.rotary import cos_sin_cache, rotary_embedding
    from weft.runtime.executor.attention.torch_backend import TorchAttentionBackend
    from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend
    from weft.runtime.executor.memory import KVPool
    from weft.runtime.executor.shared_prefix import MEMBERS_PER_BLOCK, SharedPrefixPlan

    heads, hkv, dim, shared_len, pad = 4, 1, 32, 40, 8  # Gemma 3 270M's 4 q heads per kv head
    scale = dim**-0.5
    pool = KVPool(900, 1, hkv, dim, torch.float32, "cpu")
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = torch.zeros(10, 128, dtype=torch.int64)  # row 0: the padding row
    rows = [3, 1, 7, 2, 5]
    own = [5, 9, 1, 30, 12]
    shared_slots, nxt = torch.arange(10, 10 + shared_len), 100
    for b, n in enumerate(own):  # requests 0-2 share their first shared_len slots
        first = shared_slots if b < 3 else torch.arange(nxt, nxt + shared_len)
        nxt += 0 if b < 3 else shared_len
        table[rows[b], : shared_len + n] = torch.cat([first, torch.arange(nxt, nxt + n)])
        nxt += n
    seq = [shared_len + n for n in own]

    def step(ext: list[int], order: list[int] | None = None, n: int = 0, shared: Any = None) -> Any:
        return step_batch(table, rows, seq, ext, order, n, shared)

    def torch_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: Any, w: int | None) -> Any:
        reference = TorchAttentionBackend(pool, table)
        reference.prepare(fb)
        return reference.forward(q, k, v, 0, fb, scale, w)

    def qkv(tokens: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(tokens, h, dim) for h in (heads, hkv, hkv))

    plan = SharedPrefixPlan(
        kv_starts=[shared_len] * 3 + [0, 0],
        block_members=[[0, 1, 2] + [-1] * (MEMBERS_PER_BLOCK - 3)],
        block_rows=[rows[0]],
        block_lens=[shared_len],
    )
    cache = cos_sin_cache(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), 128)
    backend = TritonAttentionBackend(pool, table)
    backend.shared_prefix = True
    assert backend.supports_sliding_window
    tol = TOL[torch.float32]
    for window in (7, 45, None):
        # two prefills over cached prefixes (on their own slots), three decodes
        mixed = step([20, 33, 1, 1, 1], order=[3, 4, 0, 1, 2])
        q, k, v = qkv(56)
        want = torch_out(q, k, v, mixed, window)
        backend.prepare(mixed)
        assert backend.num_extend == 2
        assert_close(backend.forward(q, k, v, 0, mixed, scale, window), want, tol)

        decode = step([1] * 5)
        q, k, v = qkv(5)
        q_rot, k_rot = q.clone(), k.clone()
        rotary_embedding(decode.positions, q_rot, k_rot, cache)
        want = torch_out(q_rot, k_rot, v, decode, window)
        backend.prepare(decode)
        assert backend.rotates(decode)
        got = backend.forward_rotating(q, k, v, 0, decode, scale, cache, sliding_window=window)
        assert_close(got, want, tol)

        grouped = step([1] * 5, shared=plan)
        q, k, v = qkv(5)
        want = torch_out(q, k, v, grouped, window)
        backend.prepare(grouped)
        assert backend.shared is not None
        assert_close(backend.forward(q, k, v, 0, grouped, scale, window), want, tol)

        static = step([1] * 5, n=pad)  # what a graph of size `pad` captured: padded rows 0
        q, k, v = (torch.cat([x, torch.zeros(pad - 5, *x.shape[1:])]) for x in (q, k, v))
        for shared in (True, False):
            backend.prepare_graph(static, shared)
            backend.prepare_replay(grouped if shared else decode, pad, shared)
            out = backend.forward(q, k, v, 0, static, scale, window)
            assert_close(out[:5], want, tol)
            assert not out[5:].any(), "padded rows attend nothing"
    # a windowed layer's split count is fitted to its window, per batch size (graph-safe)
    assert backend._splits(pad, 16) == 1 and backend._splits(pad, 16) <= backend._splits(pad)
