"""The dense kernels on CUDA at real shapes against the float32 references: norms (QK-norm per
head too), SiLU-and-mul, the skinny GEMV, split sums, programmatic dependent chains, the grammar
mask and argmax. Skipped without CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

from kernel_cases import DEV, assert_close, ragged, random_pool, ref, wk  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


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


def test_heads_rmsnorm_in_place_equals_rmsnorm_per_head() -> None:
    """Qwen3-30B-A3B's QK-norm (32 q / 4 kv heads of 128) over a fused QKV output's views."""
    tokens, q_heads, kv_heads, dim = 64, 32, 4, 128
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device=DEV)
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim)
    wq = (1 + 0.1 * torch.randn(dim, device=DEV)).to(torch.bfloat16)
    wk_ = (1 + 0.1 * torch.randn(dim, device=DEV)).to(torch.bfloat16)
    want_q = wk.rmsnorm(q.reshape(-1, dim), wq, 1e-6).view(q.shape)
    want_k = wk.rmsnorm(k.reshape(-1, dim), wk_, 1e-6).view(k.shape)
    v_before = v.clone()
    wk.heads_rmsnorm_(q, k, wq, wk_, 1e-6)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v_before)


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


@pytest.mark.parametrize("rows", [1, 16])
def test_split_sums_here_equal_their_own_launches(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split K (GEMV) and split KV (decode attention) summed by each tile's last program to
    arrive, against the launch of their own that sums them (what runs without arrival
    counters, or past MERGE_MAX_SPLITS): the GEMV's bits are the same, the attention's within
    float32 rounding of the merge; the arrival counters are zeros after, and a graph replays
    the same result three times."""
    from weft.kernels import decode, skinny
    from weft.kernels.arrivals import arrival_counters

    @contextlib.contextmanager
    def summed_by_the_last(program: bool) -> Iterator[None]:
        """Inside, split results are summed by their last program, or else in a launch."""
        with monkeypatch.context() as patch:
            if not program:
                patch.setattr(skinny, "arrival_counters", lambda *args: None)
                patch.setattr(decode, "MERGE_MAX_SPLITS", 0)
            yield

    for n, k, silu, launch in ((4096, 14336, True, (128, 128, 4, 8, 4)),
                               (4096, 4096, False, (64, 128, 2, 4, 4)),
                               (6144, 4096, False, (64, 64, 2, 4, 8))):  # fmt: skip
        x = torch.randn(rows, (2 if silu else 1) * k, dtype=torch.bfloat16, device=DEV)
        w = (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
        outs = []
        for here in (True, False):
            with summed_by_the_last(here):
                outs.append(wk.gemv(x, w, silu_mul=silu, launch=wk.GemvLaunch(*launch)))
        assert torch.equal(outs[0], outs[1]), (n, k, launch)
        assert_close(outs[0], ref.gemv_ref(x, w, None, silu), 1e-2)
    bsz = 8 if rows == 1 else 64
    lens = ragged(bsz, 1, 2048)
    k_buffer, v_buffer, table, req_rows = random_pool(lens, 16, 8, 128, torch.bfloat16)
    q = torch.randn(bsz, 32, 128, dtype=torch.bfloat16, device=DEV)
    args = (k_buffer, v_buffer, table, req_rows, torch.tensor(lens, device=DEV))
    want = ref.decode_attention_ref(q, *args, 128**-0.5)
    for splits in (2, 32):
        plan = wk.DecodePlan(splits)
        outs = []
        for here in (True, False):
            with summed_by_the_last(here):
                nans = torch.full_like(q, float("nan"))
                outs.append(wk.decode_attention(q, *args, nans, 128**-0.5, plan))
        assert (outs[0].float() - outs[1].float()).abs().max() <= 2**-7 * outs[1].abs().max()
        assert_close(outs[0], want, 1e-2)
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *args, out, 128**-0.5, plan)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wk.decode_attention(q, *args, out, 128**-0.5, plan)
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


@pytest.mark.parametrize("rope", [False, True])
def test_a_decode_layer_of_programmatic_dependents_matches_plain_launches(rope: bool) -> None:
    """add + RMSNorm -> qkv GEMV -> rotary (K/V into the pool) -> decode attention (split, merged
    by the last) -> o_proj GEMV, twice over, the norms and GEMVs programmatic dependents as the
    runtime launches them, in one CUDA graph: bit for bit the plain launches' outputs and pool.
    `rope`: the rotation and the store in the decode kernel instead (DecodeRope)."""
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
                wk.rotary_embedding(positions, q, k, cache, kv_store=(v, k_pool, v_pool, loc))
            out = torch.empty(2, heads, dim, dtype=torch.bfloat16, device=DEV)
            plan = wk.DecodePlan(8, rope=rotate)
            wk.decode_attention(q, k_pool, v_pool, table, rows, seq_lens, out, dim**-0.5, plan)
            x = wk.gemv(out.view(2, hidden), w_o, launch=launch, pdl=pdl)
        return x, res, k_pool, v_pool

    _replays_match_plain_launches(layer_chain)


def test_apply_token_bitmask() -> None:
    logits = torch.randn(64, 128256, device=DEV)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (20, 4008), dtype=torch.int32, device=DEV)
    rows = torch.randperm(64, device=DEV)[:20]
    want = ref.apply_token_bitmask_ref(logits, bitmask, rows)
    wk.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("bsz", [1, 64, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows(bsz: int, dtype: torch.dtype) -> None:
    """Equal to torch.argmax on a 128,256-wide vocabulary: ties (bf16 rounding makes many) go
    to the first index, a NaN row to its first NaN."""
    x = (4 * torch.randn(bsz, 128256, device=DEV)).to(dtype)
    x[0, 100_000] = float("nan")
    x[-1] = x[-1].round()
    assert torch.equal(wk.argmax_rows(x), x.argmax(-1))
