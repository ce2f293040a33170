"""Sliding-window attention in the Triton decode and extend kernels on CUDA at Gemma 3 270M's
attention shape (4 q heads over 1 kv head of 256) with windows of 512 and 1024 over contexts up
to 8k, against the float32 references; the keys before each window are NaN, so a read that is
masked instead of skipped shows. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton", reason="triton is not importable")

from kernel_cases import DEV, TOL, assert_close, ragged, random_pool, ref, wk  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 1, 256  # Gemma 3 270M
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def poison_before(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
    firsts: list[int],
) -> None:  # fmt: skip
    """NaN into request b's K/V at positions [0, firsts[b]): no walk may read them."""
    slots = torch.cat([table[rows[b], : max(f, 0)] for b, f in enumerate(firsts)]).long()
    k_buffer[slots] = float("nan")
    v_buffer[slots] = float("nan")


def splits_for(bsz: int, keys: int, fp8: bool = False) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return wk.decode_num_kv_splits(bsz, KV_HEADS, keys, sms, fp8=fp8)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("window", [512, 1024])
@pytest.mark.parametrize("bsz, page", [(1, 16), (16, 16), (7, 1)])
def test_decode_attention_in_a_window(bsz: int, page: int, window: int, kv: str) -> None:
    """Ragged contexts of 1..8192 (shorter and longer than the window, one of exactly the window),
    at the runtime's split count for min(window, context), and at one split (no merge)."""
    lens = ragged(bsz, 1, 8192)
    if bsz > 3:
        lens[3] = window
    k_buffer, v_buffer, table, rows = random_pool(lens, page, KV_HEADS, DIM, torch.bfloat16,
                                                  poison=True)  # fmt: skip
    if kv == "fp8":
        k_buffer, v_buffer = k_buffer.to(FP8), v_buffer.to(FP8)
    q = torch.randn(bsz, HEADS, DIM, dtype=torch.bfloat16, device=DEV)
    seq_lens = torch.tensor(lens, device=DEV)
    args = (k_buffer, v_buffer, table, rows, seq_lens)
    expected = ref.decode_attention_ref(q, *args, DIM**-0.5, window)
    poison_before(k_buffer, v_buffer, table, rows, [n - window for n in lens])
    for splits in (splits_for(bsz, min(window, max(lens)), kv == "fp8"), 1):
        out = torch.full_like(q, float("nan"))
        wk.decode_attention(q, *args, out, DIM**-0.5, wk.DecodePlan(splits, window=window))
        assert_close(out, expected, TOL[torch.bfloat16])


@pytest.mark.parametrize("bsz", [1, 32])
def test_windowed_decode_with_rope_equals_rotary_then_decode(bsz: int) -> None:
    """The rotating launch (rope) in a window of 512 at 8k: the same output and pool bytes as the
    rotary kernel storing k and v, then a windowed decode launch."""
    window, lens = 512, ragged(bsz, 1, 8192)
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, KV_HEADS, DIM, torch.bfloat16)
    seq_lens = torch.tensor(lens, device=DEV)
    positions = seq_lens - 1
    loc = table[rows, positions].long()
    cache = wk.cos_sin_cache(1.0 / 1e6 ** (torch.arange(0, DIM, 2, device=DEV) / DIM), 8192)
    q, k, v = (torch.randn(bsz, h, DIM, dtype=torch.bfloat16, device=DEV)
               for h in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    splits = splits_for(bsz, window)
    k_pool, v_pool, q_rot, k_rot = k_buffer.clone(), v_buffer.clone(), q.clone(), k.clone()
    wk.rotary_embedding(positions, q_rot, k_rot, cache, kv_store=(v, k_pool, v_pool, loc))
    args = (table, rows, seq_lens)
    plain = wk.DecodePlan(splits, window=window)
    want = wk.decode_attention(q_rot, k_pool, v_pool, *args, torch.empty_like(q), DIM**-0.5, plain)
    rope = wk.DecodePlan(splits, window=window, rope=wk.DecodeRope(positions, cache, k, v, loc))
    got = wk.decode_attention(q, k_buffer, v_buffer, *args, torch.full_like(q, float("nan")),
                              DIM**-0.5, rope)  # fmt: skip
    assert torch.equal(k_buffer, k_pool) and torch.equal(v_buffer, v_pool)
    assert_close(got, want.float(), 1e-3)


def test_windowed_decode_replays_in_a_cuda_graph() -> None:
    """The window is a per-layer constant: a graph captured once (split count for the window)
    replays right for other lengths, shorter and longer than the window."""
    bsz, window, ctx = 8, 1024, 8192
    k_buffer, v_buffer, table, rows = random_pool([ctx] * bsz, 16, KV_HEADS, DIM, torch.bfloat16)
    q = torch.randn(bsz, HEADS, DIM, dtype=torch.bfloat16, device=DEV)
    seq_lens = torch.full((bsz,), ctx, device=DEV)
    out = torch.empty_like(q)
    plan = wk.DecodePlan(splits_for(bsz, window), window=window)

    def launch() -> None:
        wk.decode_attention(q, k_buffer, v_buffer, table, rows, seq_lens, out, DIM**-0.5, plan)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for lens in ([ctx] * bsz, ragged(bsz, 1, ctx), [window - 1, window, window + 1] * 2 + [1, 77]):
        seq_lens.copy_(torch.tensor(lens, device=DEV))
        q.normal_()
        graph.replay()
        want = ref.decode_attention_ref(q, k_buffer, v_buffer, table, rows, seq_lens, DIM**-0.5,
                                        window)  # fmt: skip
        assert_close(out, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("window", [512, 1024])
def test_extend_attention_in_a_window(window: int, pack_gqa: bool, kv: str) -> None:
    """Prefill chunks of up to 1536 new tokens over cached prefixes of up to 6k (and none), in a
    window; over an fp8 pool the new tokens are read back from their slots."""
    bsz = 6
    prefix, ext = ragged(bsz, 0, 6144), ragged(bsz, 1, 1536)
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    k_buffer, v_buffer, table, rows = random_pool(lens, 16, KV_HEADS, DIM, torch.bfloat16,
                                                  poison=True)  # fmt: skip
    tokens = sum(ext)
    q = torch.randn(tokens, HEADS, DIM, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(tokens, KV_HEADS, DIM, dtype=torch.bfloat16, device=DEV)
    v = torch.randn_like(k)
    if kv == "fp8":
        loc = torch.cat([table[rows[b], prefix[b] : lens[b]] for b in range(bsz)])
        ref.store_kv_ref(k, v, k_buffer, v_buffer, loc)
        k_buffer, v_buffer = k_buffer.to(FP8), v_buffer.to(FP8)
    ext_t = torch.tensor(ext, device=DEV)
    meta = (rows, torch.tensor(prefix, device=DEV), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    args = (q, k, v, k_buffer, v_buffer, table, *meta)
    expected = ref.extend_attention_ref(*args, DIM**-0.5, window)
    poison_before(k_buffer, v_buffer, table, rows, [p - window + 1 for p in prefix])
    out = torch.full_like(q, float("nan"))
    wk.extend_attention(*args, out, DIM**-0.5, max(ext), pack_gqa=pack_gqa, window=window)
    assert_close(out, expected, TOL[torch.bfloat16])


def test_triton_backend_on_a_hybrid_pool_replays_in_a_cuda_graph() -> None:
    """The triton backend over a HybridKVPool (two windowed layers, one global) in a captured
    decode step: replayed for two steps, between which the pool's map changes in place (pages
    leave the window, a new page joins: flush()), it equals the torch backend eagerly. Layer 0
    stores through kv_store_target (the windowed slots gathered inside the graph), layer 1 rotates
    and stores in the decode kernel, layer 2 reads full slots. SWA rows no slot maps to are NaN."""
    from weft.runtime.executor.attention.torch_backend import TorchAttentionBackend
    from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend
    from weft.runtime.executor.batch import ForwardBatch, ForwardMode
    from weft.runtime.executor.swa_memory import HybridKVPool, SWAPageAllocator

    page, window, windows = 16, 512, [512, 512, None]
    lens = [700, 1519, 31, 2048]  # after the first step (1519: a page leaves at the second)
    bsz, pad = len(lens), 8
    alloc = SWAPageAllocator(400, 300, page, window, DEV)  # (271 pages held before the window)
    pool = HybridKVPool(400 * page, 300 * page, [w is not None for w in windows], KV_HEADS, DIM,
                        torch.bfloat16, DEV, alloc)  # fmt: skip
    host = torch.zeros(8, 4096, dtype=torch.int64)
    rows = [3, 1, 5, 2]
    pages: list[list[int]] = []
    for b, n in enumerate(lens):
        mine = alloc.alloc_pages(-(-(n + 1) // page))  # room for the second step's token
        assert mine is not None
        pages.append(mine)
        host[rows[b], : len(mine) * page] = alloc.page_slots(mine)

    def leave_window(seq: list[int]) -> None:
        for b, n in enumerate(seq):  # pages wholly before the window of the query at n - 1
            gone = [p for i, p in enumerate(pages[b]) if (i + 1) * page <= n - window]
            alloc.free_swa(alloc.page_slots(gone))
        alloc.flush()

    leave_window(lens)
    table = host.to(DEV)
    for buf in (*pool.k, *pool.v):
        buf.normal_()
    cache = wk.cos_sin_cache(1.0 / 1e4 ** (torch.arange(0, DIM, 2, device=DEV) / DIM), 4096)

    def batch(seq: list[int], n: int) -> ForwardBatch:
        seq = seq + [0] * (n - len(seq))
        r = rows + [0] * (n - len(rows))
        positions = (torch.tensor(seq) - 1).clamp(min=0)
        loc = torch.tensor([host[row, s - 1] if s else 0 for row, s in zip(r, seq, strict=True)])
        return ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(n, dtype=torch.int64,
                            device=DEV), positions=positions.to(DEV), out_cache_loc=loc.to(DEV),
                            req_rows=torch.tensor(r, device=DEV), seq_lens=torch.tensor(seq,
                            device=DEV), extend_lens=torch.ones(n, dtype=torch.int64, device=DEV),
                            seq_lens_cpu=seq, extend_lens_cpu=[1] * n)  # fmt: skip

    inputs = [tuple(torch.zeros(pad, h, DIM, dtype=torch.bfloat16, device=DEV)
                    for h in (HEADS, KV_HEADS, KV_HEADS)) for _ in windows]  # fmt: skip
    outs = [torch.empty(pad, HEADS, DIM, dtype=torch.bfloat16, device=DEV) for _ in windows]
    static = batch(lens, pad)
    backend = TritonAttentionBackend(pool, table)

    def step(attn: Any, fb: ForwardBatch, xs: list[tuple[torch.Tensor, ...]]) -> list[Any]:
        got = []
        for layer, (q, k, v) in enumerate(xs):
            if layer == 1 and isinstance(attn, TritonAttentionBackend):
                got.append(attn.forward_rotating(q, k, v, layer, fb, DIM**-0.5, cache,
                                                 sliding_window=windows[layer]))  # fmt: skip
                continue
            if layer == 1:  # the torch backend: rotated first
                q, k = q.clone(), k.clone()
                wk.rotary_embedding(fb.positions, q, k, cache)
            target = attn.kv_store_target(layer, fb)
            if target is not None:
                wk.store_kv(k, v, *target)
            got.append(attn.forward(q, k, v, layer, fb, DIM**-0.5, windows[layer],
                                    kv_stored=target is not None))  # fmt: skip
        return got

    def captured() -> None:
        for out, o in zip(outs, step(backend, static, inputs), strict=True):
            out.copy_(o)

    backend.prepare_graph(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            captured()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    for seq in (lens, [n + 1 for n in lens]):
        if seq is not lens:
            leave_window(seq)
        mapped = torch.zeros(pool.num_swa_slots, dtype=torch.bool, device=DEV)
        mapped[alloc.full_to_swa] = True
        mapped[:page] = True
        for layer in (0, 1):
            pool.k[layer][~mapped] = float("nan")
            pool.v[layer][~mapped] = float("nan")
        fb = batch(seq, bsz)
        for name in ("positions", "out_cache_loc", "seq_lens"):
            getattr(static, name)[:bsz].copy_(getattr(fb, name))
        for t in inputs:
            for x in t:
                x[:bsz].normal_()
        before = [t.clone() for t in (*pool.k, *pool.v)]
        reference = TorchAttentionBackend(pool, table)
        reference.prepare(fb)
        want = step(reference, fb, [tuple(x[:bsz] for x in t) for t in inputs])
        after = [t.clone() for t in (*pool.k, *pool.v)]
        for t, s in zip((*pool.k, *pool.v), before, strict=True):
            t.copy_(s)
        backend.prepare_replay(fb, pad)
        graph.replay()
        for out, w in zip(outs, want, strict=True):
            assert_close(out[:bsz], w.float(), TOL[torch.bfloat16])
        for i, (mine, theirs) in enumerate(zip((*pool.k, *pool.v), after, strict=True)):
            mine, theirs = (
                mine[page:].float().nan_to_num(7.0),
                theirs[page:].float().nan_to_num(7.0),
            )
            if i % len(windows) == 1:  # rotated in the decode kernel vs the rotary kernel
                assert torch.allclose(mine, theirs, atol=2e-2, rtol=2e-2)
            else:
                assert torch.equal(mine, theirs)
