"""Sliding-window attention in the Triton decode and extend kernels on CUDA at Gemma 3 270M's
attention shape (4 q heads over 1 kv head of 256) with windows of 512 and 1024 over contexts up
to 8k, against the float32 references; the keys before each window are NaN, so a read that is
masked instead of skipped shows. Skipped without CUDA."""

from __future__ import annotations

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
