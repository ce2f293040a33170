"""weft.kernels on CUDA at real shapes against the float32 references, plus decode-attention and
rmsnorm time and GB/s (printed even without -s). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bench.py"
_spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_kernels"] = bench
_spec.loader.exec_module(bench)

from support import kernel_names  # noqa: E402

from weft.kernels import reference as ref  # noqa: E402

wk = kernel_names("weft.kernels")

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
DEV = "cuda"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def assert_close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Every element written and finite; relative L2 error under tol."""
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten (NaN)"
    err = ((out.float() - expected).norm() / expected.norm()).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def ragged(n: int, lo: int, hi: int) -> list[int]:
    """n random lengths in [lo, hi], with both ends and a page boundary among them."""
    lens = torch.randint(lo, hi + 1, (n,)).tolist()
    lens[:3] = [lo, hi, max(lo, min(hi, 32))][: len(lens)]
    return lens


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
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, page, hkv, dim, dtype, poison=True)
    q = torch.randn(bsz, heads, dim, dtype=dtype, device=DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    out = torch.full_like(q, float("nan"))
    if splits is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        splits = wk.decode_num_kv_splits(bsz, hkv, max(lens), sms)
    args = (k_buffer, v_buffer, table, rows, seq_lens)
    wk.decode_attention(q, *args, out, dim**-0.5, splits)
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
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, dim, dtype, poison=True)
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
    wk.decode_attention(
        q, *args, out, dim**-0.5, 4, kv_starts=torch.tensor(starts, **i32), shared=shared
    )
    assert_close(out, ref.decode_attention_ref(q, *args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("bsz", [1, 48])
def test_decode_attention_with_rope_equals_rotary_then_decode(bsz: int, fp8: bool) -> None:
    """rope: the decode launch rotates q and the new k and stores k and v itself, as the rotary
    kernel (kv_store) and a plain decode launch after it do, at the runtime's split count."""
    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
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
    want = wk.decode_attention(q_rot, k_pool, v_pool, *args, torch.empty_like(q), 128**-0.5, splits)
    rope = wk.DecodeRope(positions, cache, k, v, loc)
    got = wk.decode_attention(q, k_buffer, v_buffer, *args, torch.full_like(q, float("nan")),
                              128**-0.5, splits, rope=rope)  # fmt: skip
    for name, mine, theirs in (("k", k_buffer, k_pool), ("v", v_buffer, v_pool)):
        differ = mine.view(torch.uint8) != theirs.view(torch.uint8)
        gap = (mine.float() - theirs.float()).abs().max().item()
        assert not differ.any(), f"{name}: {int(differ.sum())} bytes differ, by up to {gap}"
    assert_close(got, want.float(), 1e-3)


@pytest.mark.parametrize("at", ["start", "end"])
@pytest.mark.parametrize("bsz", [1, 4])
def test_decode_l2_prefetch_changes_no_result(bsz: int, at: str) -> None:
    """l2_prefetch only asks the L2 for bytes: the rotating decode launch writes the same
    output and pool bytes with it as without, and the prefetched tensor stays as it was."""
    from weft.kernels.l2 import L2Prefetch

    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
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
    for hint in (None, L2Prefetch(weight, at)):
        pool = (k_buffer.clone(), v_buffer.clone())
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *pool, table, rows, seq_lens, out, 128**-0.5, splits, rope=rope,
                            l2_prefetch=hint)  # fmt: skip
        outs.append((out, *pool))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(weight, before)
    with pytest.raises(ValueError, match="L2Prefetch.at"):
        L2Prefetch(weight, "middle").code()


def test_decode_and_extend_attention_read_an_fp8_pool() -> None:
    """kv_cache_dtype fp8_e4m3 at real shapes: bf16 queries over an e4m3 pool (read upcast)."""
    fp8 = torch.float8_e4m3fn
    lens = ragged(24, 1, 2048)
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
    k_buffer, v_buffer = k_buffer.to(fp8), v_buffer.to(fp8)
    q = torch.randn(24, 32, 128, dtype=torch.bfloat16, device=DEV)
    out = torch.full_like(q, float("nan"))
    args = (k_buffer, v_buffer, table, rows, torch.tensor(lens, device=DEV))
    wk.decode_attention(q, *args, out, 128**-0.5, 4)
    assert_close(out, ref.decode_attention_ref(q, *args, 128**-0.5), TOL[torch.bfloat16])
    prefix, ext = [700, 0, 1500, 33], [100, 300, 1, 64]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
    k_buffer, v_buffer = k_buffer.to(fp8), v_buffer.to(fp8)
    tokens = sum(ext)
    q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device=DEV)
    k, v = (torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    ext_t = torch.tensor(ext, device=DEV)
    lens_args = (torch.tensor(prefix, device=DEV), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    ext_args = (q, k, v, k_buffer, v_buffer, table, rows, *lens_args)
    expected = ref.extend_attention_ref(*ext_args, 128**-0.5)
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
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, hkv, dim, dtype, poison=True)
    k_buffer, v_buffer = k_buffer.to(torch.float8_e4m3fn), v_buffer.to(torch.float8_e4m3fn)
    q = torch.randn(40, heads, dim, dtype=dtype, device=DEV)
    args = (k_buffer, v_buffer, table, rows, torch.tensor(lens, device=DEV))
    expected = ref.decode_attention_ref(q, *args, dim**-0.5)
    for splits in (1, 4, 16):
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *args, out, dim**-0.5, splits, fp8_v_staged=staged)
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
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, page, hkv, dim, dtype, poison=True)
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


def test_rmsnorm_and_fused_add() -> None:
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device=DEV)
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    assert_close(wk.rmsnorm(x, w, 1e-5, out=out), ref.rmsnorm_ref(x, w, 1e-5), 1e-2)
    x_want, res_want = ref.fused_add_rmsnorm_ref(x, res, w, 1e-5)
    wk.fused_add_rmsnorm(x, res, w, 1e-5)
    assert_close(res, res_want, 1e-2)
    assert_close(x, x_want, 1e-2)


def test_silu_and_mul() -> None:
    gate_up = torch.randn(1024, 2 * 14336, dtype=torch.bfloat16, device=DEV)
    out = torch.full((1024, 14336), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert_close(wk.silu_and_mul(gate_up, out=out), ref.silu_and_mul_ref(gate_up), 1e-2)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(
    "n, k, silu_mul, bias",
    [(6144, 4096, False, True), (4096, 14336, True, False), (1000, 72, False, False)],
)
def test_gemv_at_the_projection_shapes(
    rows: int, n: int, k: int, silu_mul: bool, bias: bool
) -> None:
    """The skinny projection in bfloat16 (the interpreter's bf16 dots are wrong)."""
    x = torch.randn(rows, (2 if silu_mul else 1) * k, dtype=torch.bfloat16, device=DEV)
    weight = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16, device=DEV) if bias else None
    launches = (wk.GemvLaunch(), wk.GemvLaunch(64, 128, 4, 4, 4), wk.GemvLaunch(128, 64, 2, 8, 3))
    for launch in launches:
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        wk.gemv(x, weight, b, silu_mul=silu_mul, out=out, launch=launch)
        assert_close(out, ref.gemv_ref(x, weight, b, silu_mul), 1e-2)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize(
    "k, n2, silu, first, second",
    [(4096, 28672, False, (64, 128, 1, 4, 4), (64, 128, 1, 4, 6)),  # o_proj -> gate_up
     (14336, 6144, True, (128, 128, 4, 8, 4), (64, 64, 1, 4, 8))],  # down -> qkv
)  # fmt: skip
def test_folded_norms_give_the_unfolded_chain(
    rows: int, k: int, n2: int, silu: bool, first: tuple, second: tuple
) -> None:
    """Llama-3.1-8B's projection -> add + norm -> projection pairs in bfloat16, the norms folded
    into the GEMVs (AddNorm, NormedX) and replayed in a CUDA graph with programmatic dependent
    launches, against the GEMV, fused_add_rmsnorm, GEMV chain: the same residual bits, the same
    products up to the float32 order of the norm's sum."""
    hidden, eps = 4096, 1e-5
    x = torch.randn(rows, (2 if silu else 1) * k, dtype=torch.bfloat16, device=DEV)
    w1 = (torch.randn(hidden, k, device=DEV) / k**0.5).to(torch.bfloat16)
    w2 = (torch.randn(n2, hidden, device=DEV) / hidden**0.5).to(torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, dtype=torch.bfloat16, device=DEV)
    launch1, launch2 = wk.GemvLaunch(*first), wk.GemvLaunch(*second)
    y1 = wk.gemv(x, w1, silu_mul=silu, launch=launch1)
    h_want = residual.clone()
    wk.fused_add_rmsnorm(y1, h_want, gamma, eps)
    want = wk.gemv(y1, w2, launch=launch2)
    h = residual.clone()
    squares = torch.full((rows, wk.norm_tiles(hidden, launch1)), float("nan"), device=DEV)
    out = torch.full((rows, n2), float("nan"), dtype=torch.bfloat16, device=DEV)

    def folded() -> None:
        wk.gemv(x, w1, silu_mul=silu, launch=launch1, pdl=True, add_norm=wk.AddNorm(h, squares))
        wk.gemv(h, w2, out=out, launch=launch2, pdl=True,
                normed_x=wk.NormedX(gamma, squares, eps))  # fmt: skip

    folded()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        folded()
    for _ in range(3):  # each replay adds to the same start anew
        h.copy_(residual)
        out.fill_(float("nan"))
        squares.fill_(float("nan"))  # the warm-up's squares must not stand in for the replay's
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, h_want)
        assert_close(out, want.float(), 1e-3)  # a rounding of x * rstd may flip, nothing more
        assert (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    normed = ref.fused_add_rmsnorm_ref(ref.gemv_ref(x, w1, None, silu).to(torch.bfloat16),
                                       residual, gamma, eps)[0]  # fmt: skip
    assert_close(out, ref.gemv_ref(normed.to(torch.bfloat16), w2), 1e-2)


@pytest.mark.parametrize("rows", [1, 16])
def test_split_sums_here_equal_their_own_launches(rows: int) -> None:
    """Split K (GEMV) and split KV (decode attention) summed by each tile's last program to
    arrive, against the launch of their own that sums them (sum_here=False): the GEMV's bits
    are the same, the attention's within float32 rounding of the merge; the arrival counters
    are zeros after, and a graph replays the same result three times."""
    from weft.kernels.arrivals import arrival_counters

    for n, k, silu, launch in ((4096, 14336, True, (128, 128, 4, 8, 4)),
                               (4096, 4096, False, (64, 128, 2, 4, 4)),
                               (6144, 4096, False, (64, 64, 2, 4, 8))):  # fmt: skip
        x = torch.randn(rows, (2 if silu else 1) * k, dtype=torch.bfloat16, device=DEV)
        w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
        outs = [wk.gemv(x, w, silu_mul=silu, launch=wk.GemvLaunch(*launch, sum_here=here))
                for here in (True, False)]  # fmt: skip
        assert torch.equal(outs[0], outs[1]), (n, k, launch)
        assert_close(outs[0], ref.gemv_ref(x, w, None, silu), 1e-2)
    bsz = 8 if rows == 1 else 64
    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, req_rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
    q = torch.randn(bsz, 32, 128, dtype=torch.bfloat16, device=DEV)
    args = (k_buffer, v_buffer, table, req_rows, torch.tensor(lens, device=DEV))
    want = ref.decode_attention_ref(q, *args, 128**-0.5)
    for splits in (2, 32):
        outs = [wk.decode_attention(q, *args, torch.full_like(q, float("nan")), 128**-0.5, splits,
                                    sum_here=here) for here in (True, False)]  # fmt: skip
        assert (outs[0].float() - outs[1].float()).abs().max() <= 2**-7 * outs[1].abs().max()
        assert_close(outs[0], want, 1e-2)
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *args, out, 128**-0.5, splits)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wk.decode_attention(q, *args, out, 128**-0.5, splits)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, outs[0]), splits
    for owner in ("gemv", "decode"):
        counters = arrival_counters(torch.device(DEV), owner, 1)
        assert counters is not None and not counters.any(), owner


def _replays_match_plain_launches(chain: Callable[[bool], tuple[torch.Tensor, ...]]) -> None:
    """chain(pdl) captured in a CUDA graph with and without programmatic dependents: three
    replays of each equal chain(False) run eagerly, bit for bit."""
    want = chain(False)
    for pdl in (False, True):
        chain(pdl)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(pdl)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), pdl


def test_programmatic_dependents_in_a_graph_match_plain_launches() -> None:
    """RMSNorm -> GEMV -> GEMV (SiLU folded) -> RMSNorm, three times over, as programmatic
    dependents in one CUDA graph: every launch may start while the one before finishes, so a
    missing wait would read a stale input. The outputs equal the plain launches' bit for bit."""
    if not wk.supports_pdl(torch.device(DEV)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    hidden, inter = 1024, 3584
    norm_w = torch.randn(hidden, dtype=torch.bfloat16, device=DEV)
    ws = [((torch.randn(2 * inter, hidden, device=DEV) / hidden**0.5).to(torch.bfloat16),
           (torch.randn(hidden, inter, device=DEV) / inter**0.5).to(torch.bfloat16))
          for _ in range(3)]  # fmt: skip
    x0 = torch.randn(2, hidden, dtype=torch.bfloat16, device=DEV)
    launch = wk.GemvLaunch(64, 128, 2, 4, 4)

    def chain(pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, res = x0.clone(), torch.zeros_like(x0)
        for up, down in ws:
            wk.fused_add_rmsnorm(x, res, norm_w, 1e-5, pdl=pdl)
            h = wk.gemv(x, up, launch=launch, pdl=pdl)
            x = wk.gemv(h, down, silu_mul=True, launch=launch, pdl=pdl)
        wk.fused_add_rmsnorm(x, res, norm_w, 1e-5, pdl=pdl)
        return x, res

    _replays_match_plain_launches(chain)


@pytest.mark.parametrize(("rope", "trigger"), [(False, True), (True, True), (True, False)])
def test_a_decode_layer_of_programmatic_dependents_matches_plain_launches(
    rope: bool, trigger: bool
) -> None:
    """add + RMSNorm -> qkv GEMV -> rotary (K/V into the pool) -> decode attention (split and
    reduce) -> o_proj GEMV, twice over, every launch a programmatic dependent (WEFT_PDL=all) in
    one CUDA graph: bit for bit the plain launches' outputs and pool. `rope`: the rotation and
    the store in the decode kernel instead (DecodeRope). Without `trigger` the decode kernel
    lets o_proj launch only as it ends (pdl_trigger=False)."""
    if not wk.supports_pdl(torch.device(DEV)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    heads, kv_heads, dim, slots = 8, 2, 128, 8192
    hidden, width = heads * dim, (heads + 2 * kv_heads) * dim
    w_qkv = (torch.randn(width, hidden, device=DEV) / hidden**0.5).to(torch.bfloat16)
    w_o = (torch.randn(hidden, hidden, device=DEV) / hidden**0.5).to(torch.bfloat16)
    norm_w = torch.randn(hidden, dtype=torch.bfloat16, device=DEV)
    cache = wk.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, dim, 2, device=DEV) / dim), 4096)
    k0 = torch.randn(slots, kv_heads, dim, dtype=torch.bfloat16, device=DEV)
    v0 = torch.randn(slots, kv_heads, dim, dtype=torch.bfloat16, device=DEV)
    table = torch.randperm(slots - 16, device=DEV)[:4096].view(2, 2048).to(torch.int32) + 16
    rows = torch.arange(2, device=DEV)
    seq_lens = torch.tensor([700, 1500], device=DEV)
    positions = seq_lens - 1
    loc = table[rows, positions].long()
    x0 = torch.randn(2, hidden, dtype=torch.bfloat16, device=DEV)
    launch = wk.GemvLaunch(64, 128, 2, 4, 4)

    def layer_chain(pdl: bool) -> tuple[torch.Tensor, ...]:
        k_pool, v_pool = k0.clone(), v0.clone()
        x, res = x0.clone(), torch.zeros_like(x0)
        for _ in range(2):
            wk.fused_add_rmsnorm(x, res, norm_w, 1e-5, pdl=pdl)
            qkv = wk.gemv(x, w_qkv, launch=launch, pdl=pdl)
            q = qkv[:, :hidden].view(2, heads, dim)
            k = qkv[:, hidden : hidden + kv_heads * dim].view(2, kv_heads, dim)
            v = qkv[:, hidden + kv_heads * dim :].view(2, kv_heads, dim)
            rotate = None
            if rope:
                rotate = wk.DecodeRope(positions, cache, k, v, loc)
            else:
                wk.rotary_embedding(positions, q, k, cache, kv_store=(v, k_pool, v_pool, loc),
                                    pdl=pdl)  # fmt: skip
            out = torch.empty(2, heads, dim, dtype=torch.bfloat16, device=DEV)
            wk.decode_attention(q, k_pool, v_pool, table, rows, seq_lens, out, dim**-0.5, 8,
                                pdl=pdl, rope=rotate, pdl_trigger=trigger)  # fmt: skip
            x = wk.gemv(out.view(2, hidden), w_o, launch=launch, pdl=pdl)
        return x, res, k_pool, v_pool

    _replays_match_plain_launches(layer_chain)


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


def test_apply_token_bitmask() -> None:
    logits = torch.randn(64, 128256, device=DEV)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (20, 4008), dtype=torch.int32, device=DEV)
    rows = torch.randperm(64, device=DEV)[:20]
    want = ref.apply_token_bitmask_ref(logits, bitmask, rows)
    wk.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("bsz", [1, 64, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows(bsz: int, dtype: torch.dtype, capsys: pytest.CaptureFixture[str]) -> None:
    """Equal to torch.argmax on a 128,256-wide vocabulary: ties (bf16 rounding makes many) go
    to the first index, a NaN row to its first NaN; and its time beside torch's."""
    x = (4 * torch.randn(bsz, 128256, device=DEV)).to(dtype)
    x[0, 100_000] = float("nan")
    x[-1] = x[-1].round()
    assert torch.equal(wk.argmax_rows(x), x.argmax(-1))
    ours, theirs = (bench.graph_ms([fn] * 20) for fn in (lambda: wk.argmax_rows(x),
                                                                lambda: x.argmax(-1)))  # fmt: skip
    with capsys.disabled():  # shown without -s
        print(f"\n[kernels] argmax B={bsz} V=128256 {dtype}: {ours * 1e3:.1f} us, "
              f"torch {theirs * 1e3:.1f} us")  # fmt: skip


def test_bandwidth_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Time and GB/s of decode attention (B=64, kv 2048, 32/8 heads, d=128, page 16) and rmsnorm
    (T=4096, hidden 4096), next to this run's device-to-device copy bandwidth."""
    ceiling = bench.copy_gbps()
    args = bench.decode_setup(64, 2048)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = wk.decode_num_kv_splits(64, 8, 2048, sms)
    ms = bench.time_ms(lambda: wk.decode_attention(**args, num_kv_splits=splits))
    decode_gbps = bench.decode_bytes(64, 2048) / ms / 1e6
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device=DEV)
    w, y = torch.randn(4096, dtype=torch.bfloat16, device=DEV), torch.empty_like(x)
    norm_ms = bench.time_ms(lambda: wk.rmsnorm(x, w, 1e-5, out=y))
    norm_gbps = 2 * x.numel() * 2 / norm_ms / 1e6
    lines = [f"[kernels] copy ceiling {ceiling:.0f} GB/s (read + write)"]
    lines.append(f"[kernels] decode_attention B=64 kv=2048 32/8 heads d=128 page 16, {splits} splits: "
          f"{ms * 1e3:.1f} us, {decode_gbps:.0f} GB/s ({decode_gbps / ceiling:.0%} of copy)")  # fmt: skip
    lines.append(f"[kernels] rmsnorm T=4096 hidden=4096: {norm_ms * 1e3:.1f} us, {norm_gbps:.0f} GB/s "
          f"({norm_gbps / ceiling:.0%} of copy)")  # fmt: skip
    with capsys.disabled():  # shown without -s
        print("\n" + "\n".join(lines))
    assert decode_gbps > 0 and norm_gbps > 0


def test_timeline_stamps_are_ordered_and_change_no_result() -> None:
    """With a Timeline active, RMSNorm, the GEMV (split K, summed here) and the rotating decode
    kernel inside a CUDA graph write every program's four times, in order, and its SM at each
    replay, and their outputs equal the untraced launches' bit for bit."""
    from weft.kernels import timeline

    x0 = torch.randn(2, 4096, dtype=torch.bfloat16, device=DEV)
    norm_w = torch.randn(4096, dtype=torch.bfloat16, device=DEV)
    w = (torch.randn(6144, 4096, device=DEV) / 64).to(torch.bfloat16)
    lens = [700, 2048]
    k_buffer, v_buffer, table, rows = bench.random_pool(lens, 16, 8, 128, torch.bfloat16)
    seq_lens = torch.tensor(lens, device=DEV)
    loc = table[rows, seq_lens - 1].long()
    cache = wk.cos_sin_cache(1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEV) / 128), 4096)
    q, k, v = (torch.randn(2, h, 128, dtype=torch.bfloat16, device=DEV) for h in (32, 8, 8))
    rope = wk.DecodeRope(seq_lens - 1, cache, k, v, loc)

    def run() -> tuple[torch.Tensor, ...]:
        x = wk.rmsnorm(x0, norm_w, 1e-5)
        y = wk.gemv(x, w, launch=wk.GemvLaunch(64, 128, 2, 4, 4))
        pool = (k_buffer.clone(), v_buffer.clone())
        out = torch.empty_like(q)
        wk.decode_attention(q, *pool, table, rows, seq_lens, out, 128**-0.5, 8, rope=rope)
        return x, y, out, *pool

    want = run()
    trace = timeline.Timeline(DEV, capacity=4096, scratch=256)
    timeline.activate(trace)
    try:
        run()  # compile the traced variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = run()
    finally:
        timeline.activate(None)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for _ in range(2):
        trace.buf.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        records = trace.read()
        assert [r.name for r, _ in records] == ["rmsnorm", "gemv 6144x4096", "decode_split"]
        assert [r.programs for r, _ in records] == [2, 96 * 2, 2 * 8 * 8]
        for region, stamps in records:
            for s in stamps:
                assert 0 < s[0] <= s[1] <= s[2] <= s[3], (region.name, s)
                assert 0 <= s[4] < sms, (region.name, s)  # the SM it ran on
