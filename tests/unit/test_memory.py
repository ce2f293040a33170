"""KV memory on CPU: PageAllocator, ReqToTokenPool and KVPool (no model); KVCacheManager's
scenarios are in test_cache_manager.py."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import PAGE_SIZES

from weft.runtime.executor.memory import KVPool, PageAllocator, ReqToTokenPool

##### PageAllocator #####


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_zero_is_never_handed_out(page_size: int) -> None:
    alloc = PageAllocator(6, page_size, "cpu")
    assert [alloc.alloc_pages(1) for _ in range(5)] == [[1], [2], [3], [4], [5]]
    assert alloc.alloc_pages(1) is None
    alloc.free(alloc.page_slots([1, 2, 3, 4, 5]))
    assert sorted(alloc.alloc_pages(5) or []) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("num_pages", "page_size", "total_slots"),
    [(2, 1, 1), (8, 1, 7), (2, 4, 4), (8, 4, 28)],
)
def test_slot_counts(num_pages: int, page_size: int, total_slots: int) -> None:
    alloc = PageAllocator(num_pages, page_size, "cpu")
    assert alloc.total_slots == alloc.free_slots == total_slots
    alloc.alloc_pages(1)
    assert alloc.free_slots == total_slots - page_size
    assert alloc.total_slots == total_slots


@pytest.mark.parametrize("num_pages", [0, 1])
def test_pool_needs_a_page_beyond_the_reserved_one(num_pages: int) -> None:
    with pytest.raises(ValueError, match="more than 1 page"):
        PageAllocator(num_pages, 4, "cpu")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_free_round_trip(page_size: int) -> None:
    alloc = PageAllocator(8, page_size, "cpu")
    got = alloc.alloc_pages(3)
    assert got is not None and len(set(got)) == 3 and 0 not in got
    assert alloc.free_slots == 4 * page_size
    alloc.free(alloc.page_slots(got))
    assert alloc.free_slots == 7 * page_size
    assert sorted(alloc.alloc_pages(7) or []) == list(range(1, 8))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_more_than_free_takes_nothing(page_size: int) -> None:
    alloc = PageAllocator(5, page_size, "cpu")
    first = alloc.alloc_pages(2)
    assert alloc.alloc_pages(3) is None
    assert alloc.free_slots == 2 * page_size
    rest = alloc.alloc_pages(2)
    assert first is not None and rest is not None
    assert sorted(first + rest) == [1, 2, 3, 4]
    assert alloc.alloc_pages(0) == []


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("what", ["slot 0", "last slot of page 0", "page 0 with a real page"])
def test_freeing_the_reserved_page_asserts_and_frees_nothing(page_size: int, what: str) -> None:
    alloc = PageAllocator(4, page_size, "cpu")
    alloc.alloc_pages(1)  # page 1
    slots = {
        "slot 0": [0],
        "last slot of page 0": [page_size - 1],
        "page 0 with a real page": [page_size, 0],
    }[what]
    with pytest.raises(AssertionError, match="reserved"):
        alloc.free(torch.tensor(slots, dtype=torch.int64))
    assert alloc.free_slots == 2 * page_size


@pytest.mark.parametrize(
    ("page_size", "pages", "slots"),
    [
        (1, [3, 1], [3, 1]),
        (4, [2], [8, 9, 10, 11]),
        (4, [3, 1], [12, 13, 14, 15, 4, 5, 6, 7]),
        (4, [], []),
    ],
)
def test_page_slots_layout(page_size: int, pages: list[int], slots: list[int]) -> None:
    out = PageAllocator(8, page_size, "cpu").page_slots(pages)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == slots


def test_free_gives_back_each_touched_page_once() -> None:
    alloc = PageAllocator(4, 4, "cpu")
    assert alloc.alloc_pages(3) == [1, 2, 3]
    alloc.free(torch.tensor([5, 6], dtype=torch.int64))  # two slots of page 1: the page, once
    assert alloc.free_slots == 4
    alloc.free(torch.tensor([9], dtype=torch.int64))  # a partial tail: its whole page
    assert alloc.free_slots == 8
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert sorted(alloc.alloc_pages(2) or []) == [1, 2]
    assert alloc.alloc_pages(1) is None


def test_pages_are_handed_out_lowest_first_whatever_the_order_of_frees() -> None:
    """Freed pages scattered over the pool (finished requests, evictions) are reused from the
    pool's low end, so what is in use stays packed there."""
    alloc = PageAllocator(64, 16, "cpu")
    held = alloc.alloc_pages(63)
    assert held == list(range(1, 64))
    for pages in ([40, 41, 42], [7], [63, 20], [3, 4]):  # freed in no particular order
        alloc.free(alloc.page_slots(pages))
    assert alloc.alloc_pages(4) == [3, 4, 7, 20]
    assert alloc.alloc_pages(4) == [40, 41, 42, 63]
    assert alloc.alloc_pages(1) is None


##### ReqToTokenPool and KVPool #####


def test_req_slots_alloc_until_empty() -> None:
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.table.shape == (3, 8) and pool.table.dtype == torch.int64
    assert [pool.alloc() for _ in range(3)] == [0, 1, 2]
    assert pool.available == 0
    assert pool.alloc() is None
    pool.free(1)
    assert pool.available == 1
    assert pool.alloc() == 1


@pytest.mark.parametrize("allocated_first", [True, False])
def test_req_slot_double_free_asserts(allocated_first: bool) -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    if allocated_first:
        row = pool.alloc()
        assert row is not None
        pool.free(row)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(0)
    assert pool.available == 2


def test_kv_pool_store_and_bytes_per_slot() -> None:
    pool = KVPool(8, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16, device="cpu")
    assert pool.k[0].shape == pool.v[1].shape == (8, 2, 4)
    loc = torch.tensor([3, 5])
    pool.store(1, loc, torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0))
    assert pool.k[1].dtype == torch.float16
    assert pool.k[1][loc].eq(1).all() and pool.v[1][loc].eq(2).all()
    assert pool.k[1].sum() == 16 and pool.k[0].abs().sum() == 0
    assert KVPool.bytes_per_slot(2, 2, 4, torch.float16) == 2 * 2 * 2 * 4 * 2
