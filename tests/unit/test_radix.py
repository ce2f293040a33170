"""Unit tests for weft.radix: RadixCache match/insert/split, LRU eviction, locks, pages, NoCache."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from weft.radix import MatchResult, NoCache, PrefixCache, RadixCache, TreeNode


class RecordingAllocator:
    """Fake KV allocator: remembers every free() call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.dim() == 1
        self.calls.append(indices.tolist())

    def freed(self) -> list[int]:
        return sorted(s for call in self.calls for s in call)


def make(page_size: int = 1) -> tuple[RadixCache, RecordingAllocator]:
    alloc = RecordingAllocator()
    return RadixCache(alloc, page_size=page_size), alloc


def slots(key: Sequence[int], base: int) -> torch.Tensor:
    return torch.arange(base, base + len(key), dtype=torch.int64)


def insert_all(cache: RadixCache, keys: Sequence[Sequence[int]]) -> None:
    """Insert keys[j] with slots 100*j + position (so expected indices are easy to write)."""
    for j, key in enumerate(keys):
        cache.insert(key, slots(key, 100 * j))


# ---------------------------------------------------------------------------- match / insert


MATCH_CASES = [
    # (page_size, inserted keys, query, expected indices)
    (1, [], [1, 2, 3], []),
    (1, [[1, 2, 3]], [], []),
    (1, [[1, 2, 3]], [1, 2, 3], [0, 1, 2]),
    (1, [[1, 2, 3]], [1, 2, 3, 4], [0, 1, 2]),
    (1, [[1, 2, 3]], [1, 2], [0, 1]),  # ends inside a node: split
    (1, [[1, 2, 3]], [2, 3], []),
    (1, [[1, 2, 3], [1, 2, 4]], [1, 2, 4, 5], [0, 1, 102]),
    (1, [[1, 2, 3, 4, 5], [1, 2, 9]], [1, 2, 3, 4], [0, 1, 2, 3]),
    (1, [[1, 2], [1, 2, 3, 4]], [1, 2, 3, 4], [0, 1, 102, 103]),
    (2, [[1, 2, 3, 4], [1, 2, 3, 5]], [1, 2, 3, 5], [0, 1, 102, 103]),  # sibling pages
    (2, [[1, 2, 3, 4], [1, 2, 3, 5]], [1, 2, 3, 6], [0, 1]),  # differs mid-page: no 2nd page
    (4, [[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 9], [0, 1, 2, 3]),
    (4, [[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5], [0, 1, 2, 3]),  # query's partial page
    (4, [[1, 2, 3, 4, 5, 6]], [1, 2, 3, 4, 5, 6], [0, 1, 2, 3]),  # partial page never inserted
    (4, [[1, 2, 3]], [1, 2, 3], []),
    (
        4,
        [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [0, 1, 2, 3, 104, 105, 106, 107],
    ),
]


@pytest.mark.parametrize(("page_size", "inserts", "query", "expected"), MATCH_CASES)
def test_match_prefix(
    page_size: int, inserts: list[list[int]], query: list[int], expected: list[int]
) -> None:
    cache, _ = make(page_size)
    insert_all(cache, inserts)
    result = cache.match_prefix(query)
    assert isinstance(result, MatchResult)
    assert result.indices.dtype == torch.int64
    assert result.indices.tolist() == expected
    # last_node ends exactly at the match: its path from the root spells the matched prefix.
    path: list[int] = []
    node = result.last_node
    while node.parent is not None:
        path[:0] = node.key
        node = node.parent
    assert node is cache.root_node and path == query[: len(expected)]
    cache.check_integrity()


INSERT_CASES = [
    # (page_size, prior keys, key, expected return, expected total_size after)
    (1, [], [1, 2, 3], 0, 3),
    (1, [[1, 2, 3]], [1, 2, 3], 3, 3),
    (1, [[1, 2, 3]], [1, 2, 3, 4], 3, 4),
    (1, [[1, 2, 3]], [1, 2], 2, 3),
    (1, [[1, 2, 3]], [1, 5], 1, 4),
    (1, [[1, 2, 3]], [], 0, 3),
    (4, [], [1, 2, 3], 0, 0),
    (4, [], [1, 2, 3, 4, 5], 0, 4),
    (4, [[1, 2, 3, 4]], [1, 2, 3, 4, 5, 6], 4, 4),
    (4, [[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 9, 9], 4, 12),
    (2, [[1, 2, 3, 4]], [1, 2, 3, 9, 5], 2, 6),
]


@pytest.mark.parametrize(("page_size", "prior", "key", "expected", "total"), INSERT_CASES)
def test_insert_returns_existing_prefix_len(
    page_size: int, prior: list[list[int]], key: list[int], expected: int, total: int
) -> None:
    cache, alloc = make(page_size)
    insert_all(cache, prior)
    assert cache.insert(key, slots(key, 1000)) == expected
    assert cache.total_size() == cache.evictable_size() == total
    assert alloc.calls == []  # insert never frees: the caller frees the duplicates
    cache.check_integrity()


def test_insert_keeps_the_tree_owned_slots_and_clones_them() -> None:
    cache, _ = make()
    cache.insert([1, 2], torch.tensor([5, 6]))
    value = torch.tensor([50, 60, 70])
    assert cache.insert([1, 2, 3], value) == 2
    value.fill_(-1)  # the caller reuses its buffer
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [5, 6, 70]


@pytest.mark.parametrize(
    "value",
    [torch.tensor([1, 2]), torch.tensor([1, 2, 3], dtype=torch.int32), torch.zeros(3, 1).long()],
    ids=["short", "int32", "2-D"],
)
@pytest.mark.parametrize("cls", [RadixCache, NoCache])
def test_insert_rejects_bad_values(cls: Callable[[None], PrefixCache], value: torch.Tensor) -> None:
    cache = cls(None)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], value)


def test_split_structure() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5], slots(range(5), 0))
    last = cache.match_prefix([1, 2, 3, 9]).last_node
    assert last.key == (1, 2, 3) and last.value.tolist() == [0, 1, 2]
    assert last.parent is cache.root_node and list(cache.root_node.children) == [(1,)]
    (tail,) = last.children.values()
    assert tail.key == (4, 5) and tail.value.tolist() == [3, 4] and tail.parent is last
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [0, 1, 2, 3, 4]
    assert cache.total_size() == 5
    cache.check_integrity()


def test_split_at_page_boundary() -> None:
    cache, _ = make(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], slots(range(6), 0))
    assert cache.insert([1, 2, 3, 9, 5, 6], slots(range(6), 10)) == 2
    (upper,) = cache.root_node.children.values()
    assert upper.key == (1, 2)
    assert {k: c.key for k, c in upper.children.items()} == {
        (3, 4): (3, 4, 5, 6),
        (3, 9): (3, 9, 5, 6),
    }
    cache.check_integrity()


# ---------------------------------------------------------------------------- eviction


A, B, C = [1, 1], [2, 2], [3, 3]  # slots: A -> 0, 1; B -> 10, 11; C -> 20, 21

LRU_CASES = [
    # (touches after inserting A, B, C in order, expected free() calls of evict(1) repeated)
    ([], [[0, 1], [10, 11], [20, 21]]),
    ([("match", A)], [[10, 11], [20, 21], [0, 1]]),
    ([("match", B), ("match", A)], [[20, 21], [10, 11], [0, 1]]),
    ([("insert", A)], [[10, 11], [20, 21], [0, 1]]),
    ([("match", A), ("match", [3, 3, 7])], [[10, 11], [0, 1], [20, 21]]),
    ([("match", [3, 9])], [[0, 1], [10, 11], [21], [20]]),  # C split: the untouched tail is oldest
    ([("match", [1]), ("match", [2, 2])], [[1], [20, 21], [0], [10, 11]]),
]


@pytest.mark.parametrize(("touches", "expected"), LRU_CASES)
def test_lru_eviction_order(
    touches: list[tuple[str, list[int]]], expected: list[list[int]]
) -> None:
    cache, alloc = make()
    for key, base in ((A, 0), (B, 10), (C, 20)):
        cache.insert(key, slots(key, base))
    for op, key in touches:
        if op == "match":
            cache.match_prefix(key)
        else:
            cache.insert(key, slots(key, 500))
    freed = []
    for _ in expected:
        freed.append(cache.evict(1))
        cache.check_integrity()
    assert alloc.calls == expected
    assert freed == [len(call) for call in expected]
    assert cache.evict(1) == 0 and cache.total_size() == 0


def test_evict_parent_becomes_candidate_and_whole_nodes_are_freed() -> None:
    cache, alloc = make()
    cache.insert([1, 2, 3], slots(range(3), 0))
    cache.insert([1, 2, 4], slots(range(3), 10))  # splits: (1,2) -> {(3), (4)}
    assert cache.evict(1) == 1 and alloc.calls == [[2]]
    assert cache.evict(2) == 3 and alloc.calls == [[2], [12], [0, 1]]  # overshoots to whole nodes
    assert cache.total_size() == 0 and cache.root_node.children == {}


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_receives_exactly_the_evicted_slots(page_size: int) -> None:
    cache, alloc = make(page_size)
    keys = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], [1, 2, 3, 4]]
    owned: set[int] = set()
    for j, key in enumerate(keys):
        value = slots(key, 100 * j)
        n = cache.insert(key, value)
        owned |= set(value[n : len(key) // page_size * page_size].tolist())
    assert cache.total_size() == len(owned)
    assert cache.evict(10**6) == len(owned)
    assert alloc.freed() == sorted(owned)
    for call in alloc.calls:  # whole, page-aligned pages
        assert len(call) % page_size == 0
        for i in range(0, len(call), page_size):
            page = call[i : i + page_size]
            assert page[0] % page_size == 0 and page == list(range(page[0], page[0] + page_size))


def test_evict_nothing_requested_or_nothing_evictable() -> None:
    cache, alloc = make()
    assert cache.evict(5) == 0
    cache.insert([1, 2], slots(range(2), 0))
    assert cache.evict(0) == 0 and cache.evict(-1) == 0
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert cache.evict(5) == 0 and alloc.calls == []


# ---------------------------------------------------------------------------- locks


def test_locked_nodes_are_never_evicted() -> None:
    cache, alloc = make()
    cache.insert([1, 2, 3, 4], slots(range(4), 0))
    cache.insert([1, 2, 5, 6], slots(range(4), 10))
    cache.insert([7, 7], slots(range(2), 20))
    locked = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(100) == 4  # (5,6) and (7,7) only
    assert alloc.freed() == [12, 13, 20, 21]
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == [0, 1, 2, 3]
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    cache.dec_lock_ref(locked)
    assert cache.evict(100) == 4 and cache.total_size() == 0
    cache.check_integrity()


def test_locked_inner_node_keeps_only_itself() -> None:
    cache, alloc = make()
    cache.insert([1, 2, 3, 4], slots(range(4), 0))
    cache.insert([1, 2, 5, 6], slots(range(4), 10))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert cache.evict(100) == 4
    assert alloc.freed() == [2, 3, 12, 13]
    assert (cache.evictable_size(), cache.protected_size()) == (0, 2)


def test_lock_accounting() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4, 5], slots(range(5), 0))
    cache.insert([1, 2, 3, 9], slots(range(4), 10))  # (1,2,3) -> {(4,5), (9)}
    long = cache.match_prefix([1, 2, 3, 4, 5]).last_node
    short = cache.match_prefix([1, 2, 3, 9]).last_node
    steps: list[tuple[Callable[[TreeNode], None], TreeNode, tuple[int, int]]] = [
        # (operation, node, (evictable, protected) after)
        (cache.inc_lock_ref, long, (1, 5)),
        (cache.inc_lock_ref, short, (0, 6)),
        (cache.inc_lock_ref, long, (0, 6)),
        (cache.dec_lock_ref, long, (0, 6)),
        (cache.dec_lock_ref, long, (2, 4)),
        (cache.dec_lock_ref, short, (6, 0)),
        (cache.inc_lock_ref, cache.root_node, (6, 0)),  # empty match: no-op
        (cache.dec_lock_ref, cache.root_node, (6, 0)),
    ]
    for i, (op, node, sizes) in enumerate(steps):
        op(node)
        assert (cache.evictable_size(), cache.protected_size()) == sizes, f"step {i}"
        assert cache.total_size() == 6
        cache.check_integrity()
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(long)


def test_lock_survives_a_later_split() -> None:
    cache, _ = make()
    cache.insert([1, 2, 3, 4], slots(range(4), 0))
    held = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(held)
    cache.match_prefix([1, 2])  # splits the locked node
    cache.insert([1, 2, 7], slots(range(3), 10))
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.check_integrity()
    cache.dec_lock_ref(held)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.check_integrity()


# ---------------------------------------------------------------------------- reset, NoCache


def test_reset_frees_everything() -> None:
    cache, alloc = make(page_size=2)
    cache.insert([1, 2, 3, 4], slots(range(4), 0))
    cache.insert([1, 2, 5, 6, 7], slots(range(5), 10))
    root_match = cache.match_prefix([9, 9])
    cache.inc_lock_ref(root_match.last_node)  # a request with an empty match holds the root
    cache.reset()
    assert alloc.freed() == [0, 1, 2, 3, 12, 13]
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.match_prefix([1, 2, 3, 4]).indices.numel() == 0
    cache.dec_lock_ref(root_match.last_node)
    cache.check_integrity()
    cache.insert([1, 2], slots(range(2), 0))  # usable again
    assert cache.match_prefix([1, 2]).indices.tolist() == [0, 1]


def test_reset_refuses_while_locked() -> None:
    cache, alloc = make()
    cache.insert([1, 2], slots(range(2), 0))
    cache.inc_lock_ref(cache.match_prefix([1]).last_node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert alloc.calls == [] and cache.total_size() == 2


def test_allocator_none_drops_values() -> None:
    cache = RadixCache(None)
    cache.insert([1, 2, 3], slots(range(3), 0))
    assert cache.evict(1) == 3
    cache.insert([1, 2, 3], slots(range(3), 0))
    cache.reset()
    assert cache.total_size() == 0


@pytest.mark.parametrize(("page_size", "key", "aligned"), [(1, [1, 2, 3], 3), (4, [1] * 6, 4)])
def test_no_cache(page_size: int, key: list[int], aligned: int) -> None:
    alloc = RecordingAllocator()
    cache = NoCache(alloc, page_size=page_size)
    assert isinstance(cache, PrefixCache)
    for _ in range(2):
        assert cache.insert(key, slots(key, 0)) == aligned
        result = cache.match_prefix(key)
        assert result.indices.numel() == 0 and result.indices.dtype == torch.int64
        assert result.last_node is cache.root_node
        cache.inc_lock_ref(result.last_node)
        assert cache.evict(100) == 0
        assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
        cache.dec_lock_ref(result.last_node)
        cache.check_integrity()
        cache.reset()
    assert alloc.calls == []


# ---------------------------------------------------------------------------- check_integrity


def _corrupt_node_kids(c: RadixCache) -> tuple[TreeNode, TreeNode, TreeNode]:
    upper = c.root_node.children[(1, 2)]
    return upper, upper.children[(3, 4)], upper.children[(5, 6)]


def _bump_lock_keep_sizes(c: RadixCache) -> None:
    leaf = _corrupt_node_kids(c)[1]
    leaf.lock_ref = 1  # ... without locking its parent
    c._evictable -= 2
    c._protected += 2


def _rekey(c: RadixCache) -> None:
    upper, leaf, _ = _corrupt_node_kids(c)
    upper.children[(7, 7)] = upper.children.pop((3, 4))


def _odd_length(c: RadixCache) -> None:
    leaf = _corrupt_node_kids(c)[1]
    leaf.key, leaf.value = leaf.key[:1], leaf.value[:1]
    c._evictable -= 1


CORRUPTIONS: dict[str, tuple[Callable[[RadixCache], None], str]] = {
    "negative lock_ref": (lambda c: setattr(_corrupt_node_kids(c)[1], "lock_ref", -1), "lock_ref"),
    "evictable counter": (lambda c: setattr(c, "_evictable", c._evictable + 1), "sizes"),
    "protected counter": (lambda c: setattr(c, "_protected", 3), "sizes"),
    "short value": (
        lambda c: setattr(_corrupt_node_kids(c)[1], "value", torch.tensor([2])),
        "value shape",
    ),
    "duplicate slot": (
        lambda c: setattr(_corrupt_node_kids(c)[2], "value", torch.tensor([2, 13])),
        "duplicate",
    ),
    "parent link": (lambda c: setattr(_corrupt_node_kids(c)[1], "parent", c.root_node), "parent"),
    "child key": (_rekey, "first page"),
    "child locked, parent not": (_bump_lock_keep_sizes, "children's"),
    "partial page": (_odd_length, "multiple of page_size"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_integrity_catches_corruption(name: str) -> None:
    cache, _ = make(page_size=2)
    cache.insert([1, 2, 3, 4], slots(range(4), 0))
    cache.insert([1, 2, 5, 6], slots(range(4), 10))  # (1,2) -> {(3,4), (5,6)}
    cache.check_integrity()
    corrupt, message = CORRUPTIONS[name]
    corrupt(cache)
    with pytest.raises(RuntimeError, match=message):
        cache.check_integrity()
