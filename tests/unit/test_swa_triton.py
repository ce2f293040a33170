"""The hybrid sliding-window KV pool in the Triton kernels and backend on CPU under
TRITON_INTERPRET=1: the decode and extend kernels read (and the rotating decode stores) a windowed
layer's K/V through a slot map (the pool's full_to_swa), against the float32 references; and the
triton backend on a HybridKVPool equals the torch backend on the same pool (decode, rotating
decode, extend over cached prefixes, a mixed step, a shared-prefix plan, graph-style
prepare_graph / prepare_replay with padded rows; fp32 and fp8 pools). SWA rows that no full slot
maps to (pages given back: their tokens left the window) hold NaN, so a read shows."""

from __future__ import annotations

from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from kv_helpers import step_batch
from test_kernel_extend import FP8, extend_args
from test_kernels import INTERPRETING, NAN, TOL, assert_close, make_pool

interpreted = test_kernels.interpreted_in(__file__)

if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


def to_swa(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    spans: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of request b's positions spans[b] = [first, end) moved to shuffled rows of a
    new buffer (row 0 reserved): (k_swa, v_swa, slot_map [num_full_slots]). Every other full slot
    maps to row 0, and every row no slot maps to (row 0 too) is NaN."""
    kept = torch.cat([table[rows[b], max(f, 0) : e] for b, (f, e) in enumerate(spans)]).long()
    n = kept.numel()
    swa_rows = torch.randperm(n + 5)[:n] + 1  # spare rows stay NaN
    slot_map = torch.zeros(k_buffer.shape[0], dtype=torch.int64)
    slot_map[kept] = swa_rows
    shape = (n + 6, *k_buffer.shape[1:])
    k_swa = torch.full(shape, NAN, dtype=k_buffer.dtype)
    v_swa = torch.full(shape, NAN, dtype=v_buffer.dtype)
    k_swa[swa_rows], v_swa[swa_rows] = k_buffer[kept], v_buffer[kept]
    return k_swa, v_swa, slot_map


@pytest.mark.parametrize(
    "dtype, splits, window, rope",
    [
        (torch.float32, 1, 9, False),
        (torch.float16, 4, 20, False),
        (torch.float32, 3, None, False),  # a map without a window: every key mapped
        (torch.float32, 4, 9, True),
        (torch.float32, 1, 20, True),
    ],
)
@interpreted
def test_decode_reads_through_a_slot_map(
    dtype: torch.dtype, splits: int, window: int | None, rope: bool
) -> None:
    """decode_attention over the SWA rows with the map = the reference over the full pool; with
    rope, the new token's k (rotated) and v land at slot_map[loc]."""
    lens, heads, hkv, dim = [37, 1, 70, 12], 8, 2, 32
    filled = [n - 1 for n in lens] if rope else lens
    pool = make_pool(lens, filled, 16, hkv, dim, dtype)
    seq_lens = torch.tensor(lens)
    q, k, v = (torch.randn(len(lens), h, dim).to(dtype) for h in (heads, hkv, hkv))
    positions = seq_lens - 1
    loc = pool.req_to_token[pool.req_rows, positions].long()
    cache = wk.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), 128)
    full_k, full_v, q_ref = pool.k_buffer.clone(), pool.v_buffer.clone(), q
    if rope:  # what rotary + store would leave in the full pool
        q_ref, k_rot = q.clone(), k.clone()
        wk.rotary_embedding(positions, q_ref, k_rot, cache)
        full_k[loc], full_v[loc] = k_rot, v
    table = (pool.req_to_token, pool.req_rows, seq_lens)
    expected = ref.decode_attention_ref(q_ref, full_k, full_v, *table, 0.125, window)
    w = window or max(lens)
    k_swa, v_swa, slot_map = to_swa(full_k, full_v, pool.req_to_token, pool.req_rows,
                                    [(n - w, n) for n in lens])  # fmt: skip
    assert not torch.equal(slot_map[loc], loc), "the map changes nothing here"
    finite = (k_swa.nan_to_num(0.0), v_swa.nan_to_num(0.0))  # the reference masks, not skips
    assert_close(ref.decode_attention_ref(q_ref, *finite, *table, 0.125, window, slot_map),
                 expected, 1e-6)  # fmt: skip
    if rope:  # the new tokens' SWA rows not stored yet
        k_swa[slot_map[loc]], v_swa[slot_map[loc]] = NAN, NAN
    plan = wk.DecodePlan(splits, block_n=16, window=window, slot_map=slot_map,
                         rope=wk.DecodeRope(positions, cache, k, v, loc) if rope else None)  # fmt: skip
    out = torch.full_like(q, NAN)
    wk.decode_attention(q, k_swa, v_swa, *table, out, 0.125, plan)
    assert_close(out, expected, TOL[dtype])
    if rope:
        assert_close(k_swa[slot_map[loc]], full_k[loc].float(), 1e-6)
        assert torch.equal(v_swa[slot_map[loc]], v)


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
@interpreted
def test_extend_reads_through_a_slot_map(kv_dtype: torch.dtype, pack_gqa: bool) -> None:
    """extend_attention over the SWA rows with the map = the reference over the full pool: the
    prefix through the map, and over an fp8 pool the new tokens too (stored at their mapped
    rows first)."""
    heads, hkv, dim, window = 8, 2, 32, 11
    prefix, ext = [20, 0, 9, 33], [5, 19, 1, 17]
    args = list(extend_args(heads, hkv, dim, 4, torch.float32, prefix, ext))
    q, k, v, k_buf, v_buf, table, rows, *lens = args
    spans = list(zip(prefix, ext, strict=True))
    loc = torch.cat([table[rows[b], p : p + e] for b, (p, e) in enumerate(spans)])
    if kv_dtype == FP8:
        k_buf, v_buf = k_buf.to(FP8), v_buf.to(FP8)
        ref.store_kv_ref(k, v, k_buf, v_buf, loc.long())
    expected = ref.extend_attention_ref(q, k, v, k_buf, v_buf, table, rows, *lens, 0.125, window)
    spans = [(p - window + 1, p + e) for p, e in zip(prefix, ext, strict=True)]
    k_swa, v_swa, slot_map = to_swa(k_buf, v_buf, table, rows, spans)
    if kv_dtype != FP8:  # the new tokens come from k and v: their rows are never read
        k_swa[slot_map[loc.long()]], v_swa[slot_map[loc.long()]] = NAN, NAN
    out = torch.full_like(q, NAN)
    wk.extend_attention(q, k, v, k_swa, v_swa, table, rows, *lens, out, 0.125, max(ext),
                        block_m=16, block_n=16, pack_gqa=pack_gqa, window=window,
                        slot_map=slot_map)  # fmt: skip
    assert_close(out, expected, TOL[torch.float32])


@interpreted
def test_decode_plan_refuses_a_slot_map_with_a_shared_prefix() -> None:
    zeros = torch.zeros(1, dtype=torch.int32)
    shared = wk.SharedPrefix(torch.full((1, 16), -1, dtype=torch.int32), zeros, zeros, 1)
    with pytest.raises(ValueError, match="slot_map cannot go with shared"):
        wk.DecodePlan(2, shared=shared, kv_starts=zeros, slot_map=torch.zeros(4, dtype=torch.int64))


##### The backend on a HybridKVPool #####

HEADS, KV_HEADS, DIM, PAGE, WINDOW = 4, 1, 32, 4, 6
WINDOWS = [WINDOW, None]  # layer 0 windowed (SWA slots), layer 1 global (full slots)
ROWS = [3, 1, 5, 2, 6]
SEQ = [30, 25, 9, 40, 17]  # each request's length after the step
SHARED = 8  # requests 0-2 share their first 8 slots (2 pages)
EXTEND = [12, 17, 3, 1, 5]  # an extend step's new tokens (request 1: all but the shared prefix)
PAD = 8  # graph-style steps: padded to 8 rows


class Hybrid:
    """A HybridKVPool (page 4, window 6) holding SEQ's requests: SWA pages given back where no
    query of the steps below reads them, the SWA rows no slot maps to NaN, as are full slots
    nobody holds."""

    def __init__(self, kv_dtype: torch.dtype) -> None:
        from weft.runtime.executor.swa_memory import HybridKVPool, SWAPageAllocator

        alloc = SWAPageAllocator(48, 30, PAGE, WINDOW, "cpu")
        self.pool = HybridKVPool(48 * PAGE, 30 * PAGE, [w is not None for w in WINDOWS],
                                 KV_HEADS, DIM, kv_dtype, "cpu", alloc)  # fmt: skip
        retired = alloc.alloc_pages(3)  # a request whose tokens all left the window
        assert retired is not None
        alloc.free_swa(alloc.page_slots(retired))  # so full and SWA page numbers differ
        self.table = torch.zeros(8, 64, dtype=torch.int64)  # row 0: the padding row
        shared_pages = alloc.alloc_pages(SHARED // PAGE)
        assert shared_pages is not None
        for b, n in enumerate(SEQ):
            own = alloc.alloc_pages(-(-n // PAGE) - (SHARED // PAGE if b < 3 else 0))
            assert own is not None
            pages = (shared_pages if b < 3 else []) + own
            self.table[ROWS[b], :n] = alloc.page_slots(pages)[:n]
        needed = torch.cat([self.table[ROWS[b], max(n - EXTEND[b] - WINDOW + 1, 0) : n]
                            for b, n in enumerate(SEQ)])  # fmt: skip
        held = torch.cat([self.table[ROWS[b], :n] for b, n in enumerate(SEQ)])
        unread = held[~torch.isin(held // PAGE, needed // PAGE)]
        assert alloc.free_swa(unread) > 0 and alloc.swa_free_pages > 0
        for layer in range(len(WINDOWS)):
            for buf in (self.pool.k[layer], self.pool.v[layer]):
                buf.copy_(torch.randn(buf.shape).to(kv_dtype))
        mapped = torch.zeros(self.pool.num_swa_slots, dtype=torch.bool)
        mapped[alloc.full_to_swa] = True
        mapped[:PAGE] = True  # the reserved page: padded rows' keys and stores
        unheld = torch.ones(self.pool.num_slots, dtype=torch.bool)
        unheld[held], unheld[:PAGE] = False, False
        for layer, unused in ((0, ~mapped), (1, unheld)):
            rows = unused.nonzero()[:, 0]
            nan = torch.full((rows.numel(), KV_HEADS, DIM), NAN).to(kv_dtype)
            self.pool.k[layer][rows], self.pool.v[layer][rows] = nan, nan
        full_to_swa = alloc.full_to_swa
        assert (full_to_swa[held] == 0).any() and (full_to_swa[needed] != 0).all()
        assert (full_to_swa[needed] != needed).any(), "the map changes nothing here"

    def step(self, ext: list[int], order: list[int] | None = None, n: int = 0,
             shared: Any = None) -> Any:  # fmt: skip
        return step_batch(self.table, ROWS, SEQ, ext, order, n, shared)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (*self.pool.k, *self.pool.v)]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip((*self.pool.k, *self.pool.v), saved, strict=True):
            t.copy_(s)


def run_layers(
    hybrid: Hybrid, backend: Any, fb: Any, qkv: list[tuple[torch.Tensor, ...]], cache: Any = None
) -> list[torch.Tensor]:
    """Each layer's attention of the step: through forward_rotating with `cache`, else through
    kv_store_target (the rotary kernel's store) where the backend lends it, else forward."""
    outs = []
    for layer, (q, k, v) in enumerate(qkv):
        window = WINDOWS[layer]
        if cache is not None:
            outs.append(backend.forward_rotating(q, k, v, layer, fb, DIM**-0.5, cache,
                                                 sliding_window=window))  # fmt: skip
            continue
        target = backend.kv_store_target(layer, fb)
        if target is not None:
            ref.store_kv_ref(k, v, *target)
        outs.append(backend.forward(q, k, v, layer, fb, DIM**-0.5, window,
                                    kv_stored=target is not None))  # fmt: skip
    return outs


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
@interpreted
def test_triton_backend_on_a_hybrid_pool_equals_the_torch_backend(
    kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per step, both backends from the same pool state: the triton backend's output (both
    layers) and the pool after it (the new tokens' K/V at their SWA slots in the windowed layer,
    at their full slots in the global one) equal the torch backend's."""
    from weft.kernels.rotary import cos_sin_cache, rotary_embedding
    from weft.runtime.executor.attention import triton_backend
    from weft.runtime.executor.attention.torch_backend import TorchAttentionBackend
    from weft.runtime.executor.shared_prefix import MEMBERS_PER_BLOCK, SharedPrefixPlan

    # NOTE: the interpreter's e4m3 cast is not torch's: store as the torch backend does
    monkeypatch.setattr(triton_backend, "store_kv", ref.store_kv_ref)
    hybrid = Hybrid(kv_dtype)
    pool, table = hybrid.pool, hybrid.table
    backend = triton_backend.TritonAttentionBackend(pool, table)
    assert backend.supports_hybrid_swa_pool
    backend.shared_prefix = True
    tol = TOL[torch.float32] if kv_dtype == torch.float32 else 1e-4
    plan = SharedPrefixPlan(kv_starts=[SHARED] * 3 + [0, 0],
                            block_members=[[0, 1, 2] + [-1] * (MEMBERS_PER_BLOCK - 3)],
                            block_rows=[ROWS[0]], block_lens=[SHARED])  # fmt: skip
    cache = cos_sin_cache(1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM), 64)

    def qkv(tokens: int) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(torch.randn(tokens, h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
                for _ in WINDOWS]  # fmt: skip

    def check(fb: Any, inputs: list[tuple[torch.Tensor, ...]], prepare: Any, rotate: bool = False,
              rows: int | None = None) -> None:  # fmt: skip
        """The triton backend (prepared by `prepare`) against the torch backend over `inputs`
        (already rotated for the torch backend when `rotate`), first `rows` output rows."""
        before = hybrid.snapshot()
        reference = TorchAttentionBackend(pool, table)
        reference.prepare(fb)
        torch_in = inputs
        if rotate:
            torch_in = []
            for q, k, v in inputs:
                q, k = q.clone(), k.clone()
                rotary_embedding(fb.positions, q, k, cache)
                torch_in.append((q, k, v))
        want = run_layers(hybrid, reference, fb, torch_in)
        after = hybrid.snapshot()
        hybrid.restore(before)
        prepare()
        got = run_layers(hybrid, backend, fb, inputs, cache if rotate else None)
        for g, w in zip(got, want, strict=True):
            assert_close(g[:rows], w[:rows].float(), tol)
            if rows is not None:
                assert not g[rows:].any(), "padded rows attend nothing"
        # NOTE: the reserved page is written by padded rows (or not: the rotating kernel skips
        # them); the rope kernel's e4m3 cast is the interpreter's
        for mine, theirs in zip(hybrid.snapshot(), after, strict=True):
            if kv_dtype == torch.float32 or not rotate:
                mine, theirs = mine[PAGE:].float(), theirs[PAGE:].float()
                assert torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))
        hybrid.restore(before)

    extend = hybrid.step(EXTEND)
    check(extend, qkv(sum(EXTEND)), lambda: backend.prepare(extend))
    assert backend.num_extend == 5
    mixed = hybrid.step([12, 17, 1, 1, 1], order=[0, 1, 2, 3, 4])
    check(mixed, qkv(32), lambda: backend.prepare(mixed))
    assert backend.num_extend == 2
    decode = hybrid.step([1] * 5)
    check(decode, qkv(5), lambda: backend.prepare(decode))
    if kv_dtype == torch.float32:
        backend.prepare(decode)
        assert backend.rotates(decode)
        check(decode, qkv(5), lambda: backend.prepare(decode), rotate=True)
    grouped = hybrid.step([1] * 5, shared=plan)
    check(grouped, qkv(5), lambda: backend.prepare(grouped))
    assert backend.shared is not None  # the global layer grouped, the windowed one walked alone
    static = hybrid.step([1] * 5, n=PAD)  # what a graph of size PAD captured: padded rows 0
    for shared in (False, True):
        inputs = [tuple(torch.cat([x, torch.zeros(PAD - 5, *x.shape[1:])]) for x in t)
                  for t in qkv(5)]  # fmt: skip

        def replay(shared: bool = shared) -> None:
            backend.prepare_graph(static, shared)
            backend.prepare_replay(grouped if shared else decode, PAD, shared)

        check(static, inputs, replay, rows=5)
        if kv_dtype == torch.float32 and not shared:
            check(static, inputs, replay, rotate=True, rows=5)


@interpreted
def test_mapped_store_slots_are_gathered_again_inside_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The windowed layers' store slots (slot_map[out_cache_loc]) are gathered once per step,
    and a gather made outside a CUDA-graph capture (the warm-up runs after prepare_graph) is
    not reused inside it, where it would freeze that step's map into the graph."""
    from weft.runtime.executor.attention import triton_backend

    hybrid = Hybrid(torch.float32)
    backend = triton_backend.TritonAttentionBackend(hybrid.pool, hybrid.table)
    static = hybrid.step([1] * 5, n=PAD)
    backend.prepare_graph(static)
    warm = backend.kv_store_target(0, static)[2]
    assert backend.kv_store_target(0, static)[2] is warm  # once per step
    assert backend.kv_store_target(1, static)[2] is static.out_cache_loc  # global: unmapped
    assert torch.equal(warm, hybrid.pool.full_to_swa[static.out_cache_loc])
    monkeypatch.setattr(triton_backend, "_capturing", lambda device: True)
    captured = backend.kv_store_target(0, static)[2]
    assert captured is not warm and backend.kv_store_target(0, static)[2] is captured
    backend.prepare_graph(static)
    monkeypatch.setattr(triton_backend, "_capturing", lambda device: False)
    assert backend.kv_store_target(0, static)[2] is not captured
