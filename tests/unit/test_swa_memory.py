"""The hybrid sliding-window KV memory: full pages paired with SWA pages (alloc, free, the slot
map, giving SWA pages back alone, moving them), a deliberate leak caught, the pool's per-layer
buffers and slot mapping, and its sizing (Gemma 3 270M's 5:1 shape at the same memory)."""

from __future__ import annotations

import pytest
import torch

from weft.runtime.executor.memory import KVPool
from weft.runtime.executor.swa_memory import HybridKVPool, SWAPageAllocator, hybrid_token_counts

PAGE_SIZES = [1, 4]


def slot_map(alloc: SWAPageAllocator, page: int) -> list[int]:
    p = alloc.page_size
    return alloc.full_to_swa[page * p : (page + 1) * p].tolist()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_each_full_page_is_paired_with_its_own_swa_page(p: int) -> None:
    alloc = SWAPageAllocator(9, 5, p, window=4, device="cpu")
    pages = alloc.alloc_pages(3)
    assert pages is not None
    swa = [slot_map(alloc, q)[0] // p for q in pages]
    assert len(set(swa)) == 3 and 0 not in swa
    for q, s in zip(pages, swa, strict=True):
        assert slot_map(alloc, q) == [s * p + o for o in range(p)]
    assert (alloc.free_slots, alloc.swa_free_slots) == (5 * p, 1 * p)
    alloc.check()
    alloc.free(alloc.page_slots(pages[:2]))
    assert (alloc.free_slots, alloc.swa_free_slots) == (7 * p, 3 * p)
    assert slot_map(alloc, pages[0]) == [0] * p
    alloc.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_alloc_fails_whole_when_either_pool_is_short(p: int) -> None:
    alloc = SWAPageAllocator(9, 3, p, window=4, device="cpu")
    assert alloc.alloc_pages(3) is None  # only 2 SWA pages
    assert (alloc.free_slots, alloc.swa_free_slots) == (8 * p, 2 * p)
    assert alloc.alloc_pages(2) is not None
    assert alloc.alloc_pages(1) is None
    alloc.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_free_swa_keeps_the_full_page_and_its_later_free_frees_it_once(p: int) -> None:
    alloc = SWAPageAllocator(9, 5, p, window=4, device="cpu")
    pages = alloc.alloc_pages(2)
    assert pages is not None
    slots = alloc.page_slots(pages)
    assert alloc.free_swa(slots[:p]) == 1
    assert alloc.free_swa(slots[:p]) == 0  # already given back
    assert alloc.has_swa(slots).tolist() == [False] * p + [True] * p
    assert (alloc.free_slots, alloc.swa_free_slots) == (6 * p, 3 * p)
    alloc.free(slots)
    assert (alloc.free_slots, alloc.swa_free_slots) == (8 * p, 4 * p)
    alloc.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_adopt_moves_a_swa_page_only_where_the_target_lacks_one(p: int) -> None:
    alloc = SWAPageAllocator(9, 6, p, window=4, device="cpu")
    got = alloc.alloc_pages(4)
    assert got is not None
    dst, src = alloc.page_slots(got[:2]), alloc.page_slots(got[2:])
    alloc.free_swa(dst[:p])  # the first target page lacks its SWA page, the second has one
    moved = slot_map(alloc, got[2])
    alloc.adopt_swa(dst, src)
    assert slot_map(alloc, got[0]) == moved and slot_map(alloc, got[2]) == [0] * p
    assert alloc.has_swa(src).tolist() == [False] * p + [True] * p
    alloc.free(src)
    alloc.check()
    assert alloc.swa_free_slots == 3 * p  # 5 usable: the two targets' pages are held


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_a_leaked_swa_page_fails_the_check(p: int) -> None:
    alloc = SWAPageAllocator(9, 5, p, window=4, device="cpu")
    assert alloc.alloc_pages(2) is not None
    alloc.swa.alloc_pages(1)  # taken, paired with nothing
    with pytest.raises(RuntimeError, match="SWA pool leak"):
        alloc.check()
    alloc = SWAPageAllocator(9, 5, p, window=4, device="cpu")
    pages = alloc.alloc_pages(1)
    assert pages is not None
    alloc.full.free(alloc.page_slots(pages))  # the full page went back, its SWA page did not
    with pytest.raises(RuntimeError, match="still paired"):
        alloc.check()


@pytest.mark.parametrize("p", PAGE_SIZES)
def test_hybrid_pool_sizes_and_maps_windowed_layers(p: int) -> None:
    alloc = SWAPageAllocator(9, 4, p, window=4, device="cpu")
    windowed = [True, False, True]
    pool = HybridKVPool(9 * p, 4 * p, windowed, 2, 8, torch.float32, "cpu", alloc)
    assert [k.shape[0] for k in pool.k] == [4 * p, 9 * p, 4 * p]
    pages = alloc.alloc_pages(2)
    assert pages is not None
    slots = alloc.page_slots(pages)
    assert torch.equal(pool.slots_for(1, slots), slots)
    mapped = pool.slots_for(0, slots)
    assert torch.equal(mapped, alloc.full_to_swa[slots]) and int(mapped.min()) >= p
    k = torch.randn(len(slots), 2, 8)
    for layer in range(3):
        pool.store(layer, pool.slots_for(layer, slots), k, -k)
        assert torch.equal(pool.k[layer][pool.slots_for(layer, slots)], k)
    assert not KVPool(8, 1, 2, 8, torch.float32, "cpu").hybrid


def test_gemma3_270m_shape_holds_more_tokens_in_the_same_memory() -> None:
    # Gemma 3 270M: 18 layers, 5 sliding-window layers per global one (15 + 3), 1 KV head of
    # head_dim 256 in bfloat16
    layer_bytes = KVPool.bytes_per_slot(1, 1, 256, torch.bfloat16)
    budget = 18 * layer_bytes * 100_000  # a plain pool of 100k tokens
    plain = budget // KVPool.bytes_per_slot(18, 1, 256, torch.bfloat16)
    assert plain == 100_000
    for ratio, gain in ((0.8, 18 / 15), (0.2, 3.0), (0.125, 18 / 4.875)):
        full, swa = hybrid_token_counts(budget, layer_bytes, 3, 15, ratio)
        assert full == pytest.approx(plain * gain, abs=1)
        assert swa == int(full * ratio)
        assert (3 * full + 15 * swa) * layer_bytes <= budget
