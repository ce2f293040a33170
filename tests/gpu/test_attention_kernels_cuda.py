"""The attention kernels on CUDA at real shapes against the float32 references: paged decode
(split, shared prefix, rotating, fp8), extend, the KV store and rotary. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

from kernel_cases import DEV, TOL, assert_close, ragged, random_pool, ref, wk  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


DECODE_CASES = [
    # batch, heads, kv heads, head dim, page size, splits (None: heuristic), dtype
    (48, 32, 8, 128, 16, None, torch.bfloat16),
    (16, 32, 8, 128, 1, 1, torch.bfloat16),
    (16, 32, 32, 128, 16, 7, torch.bfloat16),
    (8, 64, 8, 128, 16, 16, torch.bfloat16),
    (33, 16, 4, 64, 16, 4, torch.float16),
    (12, 32, 8, 128, 16, 3, torch.float32),
]


@pytest.mark.parametrize("bsz, heads, hkv, dim, page, splits, dtype", DECODE_CASES)
def test_decode_attention(
    bsz: int, heads: int, hkv: int, dim: int, page: int, splits: int | None, dtype: torch.dtype
) -> None:
    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, rows = random_pool(lens, page, hkv, dim, dtype, poison=True)
    q = torch.randn(bsz, heads, dim, dtype=dtype, device=DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    out = torch.full_like(q, float("nan"))
    if splits is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = wk.decode_num_kv_splits(bsz, hkv, max(lens), sms)
    args = (k_buffer, v_buffer, table, rows, seq_lens)
    wk.decode_attention(q, *args, out, dim**-0.5, wk.DecodePlan(splits))
    assert_close(out, ref.decode_attention_ref(q, *args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_decode_attention_shared_prefix(dtype: torch.dtype) -> None:
    """Groups reading their prefix once (one of 20 members: two blocks) plus loners, against the
    reference over each request's whole table row (float8: bf16 queries over an e4m3 pool)."""
    fp8, dtype = dtype == torch.float8_e4m3fn, torch.bfloat16 if dtype.itemsize == 1 else dtype
    groups, size, prefix, loners, dim = [1000, 2048, 700], 20, 0, 5, 128
    sizes = [size, 3, 2]
    lens = [p + n for p, k in zip(groups, sizes, strict=True) for n in ragged(k, 1, 300)]
    lens += ragged(loners, 1, 3000)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, 8, dim, dtype, poison=True)
    if fp8:
        k_buffer, v_buffer = k_buffer.to(torch.float8_e4m3fn), v_buffer.to(torch.float8_e4m3fn)
    members, block_rows, block_lens, starts = [], [], [], [0] * len(lens)
    first = 0
    for p, k in zip(groups, sizes, strict=True):
        leader = rows[first]
        for b in range(first, first + k):
            table[rows[b], :p] = table[leader, :p]
            starts[b] = p
        for c in range(first, first + k, 16):
            chunk = list(range(c, min(c + 16, first + k)))
            members.append(chunk + [-1] * (16 - len(chunk)))
            block_rows.append(int(leader))
            block_lens.append(p)
        first += k
    members.append([-1] * 16)  # an unused block
    block_rows.append(0)
    block_lens.append(prefix)
    i32 = {"dtype": torch.int32, "device": DEV}
    shared = wk.SharedPrefix(
        torch.tensor(members, **i32), torch.tensor(block_rows, **i32),
        torch.tensor(block_lens, **i32), 4,
    )  # fmt: skip
    q = torch.randn(len(lens), 32, dim, dtype=dtype, device=DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    out = torch.full_like(q, float("nan"))
    args = (k_buffer, v_buffer, table, rows, seq_lens)
    plan = wk.DecodePlan(4, kv_starts=torch.tensor(starts, **i32), shared=shared)
    wk.decode_attention(q, *args, out, dim**-0.5, plan)
    assert_close(out, ref.decode_attention_ref(q, *args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("bsz", [1, 48])
def test_decode_attention_with_rope_equals_rotary_then_decode(bsz: int, fp8: bool) -> None:
    """rope: the decode launch rotates q and the new k and stores k and v itself, as the rotary
    kernel (kv_store) and a plain decode launch after it do, at the runtime's split count."""
    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, 8, 128, torch.bfloat16)
    if fp8:
        k_buffer, v_buffer = k_buffer.to(torch.float8_e4m3fn), v_buffer.to(torch.float8_e4m3fn)
    seq_lens = torch.tensor(lens, device=DEV)
    positions = seq_lens - 1
    loc = table[rows, positions].long()
    cache = wk.cos_sin_cache(1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEV) / 128), 4096)
    q, k, v = (torch.randn(bsz, h, 128, dtype=torch.bfloat16, device=DEV) for h in (32, 8, 8))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = wk.decode_num_kv_splits(bsz, 8, 2048, sms, fp8=fp8)
    k_pool, v_pool, q_rot, k_rot = k_buffer.clone(), v_buffer.clone(), q.clone(), k.clone()
    wk.rotary_embedding(positions, q_rot, k_rot, cache, kv_store=(v, k_pool, v_pool, loc))
    args = (table, rows, seq_lens)
    plain = wk.DecodePlan(splits)
    want = wk.decode_attention(q_rot, k_pool, v_pool, *args, torch.empty_like(q), 128**-0.5, plain)
    rope = wk.DecodePlan(splits, rope=wk.DecodeRope(positions, cache, k, v, loc))
    nans = torch.full_like(q, float("nan"))
    got = wk.decode_attention(q, k_buffer, v_buffer, *args, nans, 128**-0.5, rope)
    for name, mine, theirs in (("k", k_buffer, k_pool), ("v", v_buffer, v_pool)):
        differ = mine.view(torch.uint8) != theirs.view(torch.uint8)
        gap = (mine.float() - theirs.float()).abs().max().item()
        assert not differ.any(), f"{name}: {int(differ.sum())} bytes differ, by up to {gap}"
    assert_close(got, want.float(), 1e-3)


@pytest.mark.parametrize("bsz", [1, 4])
def test_decode_l2_prefetch_changes_no_result(bsz: int) -> None:
    """l2_prefetch only asks the L2 for bytes: the rotating decode launch writes the same
    output and pool bytes with it as without, and the prefetched tensor stays as it was."""
    from weft.kernels.l2 import L2Prefetch

    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, 8, 128, torch.bfloat16)
    seq_lens = torch.tensor(lens, device=DEV)
    positions = seq_lens - 1
    loc = table[rows, positions].long()
    cache = wk.cos_sin_cache(1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEV) / 128), 4096)
    q, k, v = (torch.randn(bsz, h, 128, dtype=torch.bfloat16, device=DEV) for h in (32, 8, 8))
    weight = torch.randn(4096, 4096 + 8, dtype=torch.bfloat16, device=DEV)  # ragged lines
    before = weight.clone()
    splits = wk.decode_num_kv_splits(bsz, 8, 2048, 132)
    rope = wk.DecodeRope(positions, cache, k, v, loc)
    outs = []
    for hint in (None, L2Prefetch(weight, 0.5)):
        pool = (k_buffer.clone(), v_buffer.clone())
        out = torch.full_like(q, float("nan"))
        plan = wk.DecodePlan(splits, rope=rope, l2_prefetch=hint)
        wk.decode_attention(q, *pool, table, rows, seq_lens, out, 128**-0.5, plan)
        outs.append((out, *pool))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(weight, before)


def test_decode_and_extend_attention_read_an_fp8_pool() -> None:
    """kv_cache_dtype fp8_e4m3 at real shapes: bf16 queries over an e4m3 pool (read upcast);
    extend's new tokens stored there first (store_kv) and read back from it, as decode reads them."""
    fp8 = torch.float8_e4m3fn
    lens = ragged(24, 1, 2048)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, 8, 128, torch.bfloat16)
    k_buffer, v_buffer = k_buffer.to(fp8), v_buffer.to(fp8)
    q = torch.randn(24, 32, 128, dtype=torch.bfloat16, device=DEV)
    out = torch.full_like(q, float("nan"))
    args = (k_buffer, v_buffer, table, rows, torch.tensor(lens, device=DEV))
    wk.decode_attention(q, *args, out, 128**-0.5, wk.DecodePlan(4))
    assert_close(out, ref.decode_attention_ref(q, *args, 128**-0.5), TOL[torch.bfloat16])
    prefix, ext = [700, 0, 1500, 33], [100, 300, 1, 64]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, 8, 128, torch.bfloat16)
    k_buffer, v_buffer = k_buffer.to(fp8), v_buffer.to(fp8)
    tokens = sum(ext)
    q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device=DEV)
    k, v = (torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    spans = enumerate(zip(prefix, ext, strict=True))
    loc = torch.cat([table[rows[b], p : p + e] for b, (p, e) in spans])
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    ext_t = torch.tensor(ext, device=DEV)
    lens_args = (torch.tensor(prefix, device=DEV), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    ext_args = (q, k, v, k_buffer, v_buffer, table, rows, *lens_args)
    expected = ref.extend_attention_ref(*ext_args, 128**-0.5)
    stored = (k_buffer[loc].float(), v_buffer[loc].float())
    upcast = (k_buffer.float(), v_buffer.float())  # not fp8: the reference reads k/v as given
    assert_close(expected, ref.extend_attention_ref(q, *stored, *upcast, *ext_args[5:], 128**-0.5),
                 1e-5)  # fmt: skip
    for pack_gqa in (True, False):  # V staged (the CUDA default), packed or per q head
        out = torch.full_like(q, float("nan"))
        wk.extend_attention(*ext_args, out, 128**-0.5, max(ext), pack_gqa=pack_gqa)
        assert_close(out, expected, TOL[torch.bfloat16])


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("heads, hkv, dim, dtype", [(32, 8, 128, torch.bfloat16),
                                                    (64, 8, 64, torch.float16)])  # fmt: skip
def test_fp8_decode_with_v_staged_or_sunk(
    staged: bool, heads: int, hkv: int, dim: int, dtype: torch.dtype
) -> None:
    """An fp8 pool's V tiles converted where loaded (inline PTX, the CUDA default) or in the dot
    operand: both against the reference, ragged lengths, a tile's tail masked, splits of one tile
    and of many."""
    lens = ragged(40, 1, 1700)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, hkv, dim, dtype, poison=True)
    k_buffer, v_buffer = k_buffer.to(torch.float8_e4m3fn), v_buffer.to(torch.float8_e4m3fn)
    q = torch.randn(40, heads, dim, dtype=dtype, device=DEV)
    args = (k_buffer, v_buffer, table, rows, torch.tensor(lens, device=DEV))
    expected = ref.decode_attention_ref(q, *args, dim**-0.5)
    for splits in (1, 4, 16):
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *args, out, dim**-0.5, wk.DecodePlan(splits, fp8_v_staged=staged))
        assert_close(out, expected, TOL[torch.bfloat16])


EXTEND_CASES = [
    # batch, heads, kv heads, head dim, page size, max prefix, max extend, dtype, pack_gqa
    (8, 32, 8, 128, 16, 1500, 1024, torch.bfloat16, True),
    (8, 32, 8, 128, 16, 1500, 1024, torch.bfloat16, False),
    (6, 32, 32, 128, 1, 700, 600, torch.bfloat16, False),
    (5, 64, 8, 64, 16, 0, 2048, torch.bfloat16, True),
    (16, 32, 8, 128, 16, 2000, 1, torch.bfloat16, True),
    (24, 32, 8, 128, 16, 2048, 128, torch.bfloat16, False),  # prefix sharing's extend
    (7, 28, 4, 128, 16, 900, 300, torch.float16, True),  # G = 7: 18 tokens x 7 + 2 rows
    (4, 32, 8, 128, 16, 300, 300, torch.float32, True),
    (4, 32, 8, 128, 16, 300, 300, torch.float32, False),
]


@pytest.mark.parametrize("work", [False, True], ids=["grid", "work-list"])
@pytest.mark.parametrize(
    "bsz, heads, hkv, dim, page, max_prefix, max_ext, dtype, pack_gqa", EXTEND_CASES
)
def test_extend_attention(
    bsz: int,
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    max_prefix: int,
    max_ext: int,
    dtype: torch.dtype,
    pack_gqa: bool,
    work: bool,
) -> None:
    """Over the full grid, or a work list of the query blocks (extend_work, heaviest first)."""
    prefix = ragged(bsz, 0, max_prefix)
    ext = ragged(bsz, 1, max_ext)
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    k_buffer, v_buffer, table, rows = random_pool(lens, page, hkv, dim, dtype, poison=True)
    tokens = sum(ext)
    q = torch.randn(tokens, heads, dim, dtype=dtype, device=DEV)
    k = torch.randn(tokens, hkv, dim, dtype=dtype, device=DEV)
    v = torch.randn_like(k)
    ext_t = torch.tensor(ext, device=DEV)
    meta = (rows, torch.tensor(prefix, device=DEV), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    out = torch.full_like(q, float("nan"))
    args = (q, k, v, k_buffer, v_buffer, table, *meta)
    listed = None
    if work:
        block_t = wk.extend_block_tokens(dtype, k_buffer.dtype, dim, heads // hkv, pack_gqa)
        items = wk.extend_work(ext, prefix, block_t)
        listed = torch.tensor(items, dtype=torch.int32, device=DEV).view(-1, 2)
    wk.extend_attention(*args, out, dim**-0.5, max(ext), pack_gqa=pack_gqa, work=listed)
    assert_close(out, ref.extend_attention_ref(*args, dim**-0.5), TOL[dtype])


def test_store_kv() -> None:
    k = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device=DEV)
    v = torch.randn_like(k)
    k_buffer = torch.full((70000, 8, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    v_buffer = torch.full_like(k_buffer, float("nan"))
    loc = torch.randperm(70000, device=DEV)[:4096]
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    assert int((~k_buffer.isnan()).all(-1).all(-1).sum()) == 4096


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_llama31(neox: bool) -> None:
    from weft.runtime.models.layers import rope_inv_freq

    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    cache = wk.cos_sin_cache(rope_inv_freq(128, params).to(DEV), 131072)
    positions = torch.randint(0, 131072, (4096,), device=DEV)
    qkv = torch.randn(4096, 48 * 128, dtype=torch.bfloat16, device=DEV)
    q, k = qkv[:, : 32 * 128].view(4096, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(4096, 8, 128)
    q_want, k_want = ref.rotary_embedding_ref(positions, q, k, cache, is_neox=neox)
    wk.rotary_embedding(positions, q, k, cache, is_neox=neox)
    assert_close(q, q_want, 1e-2)
    assert_close(k, k_want, 1e-2)
