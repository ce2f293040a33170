"""Property tests for weft.radix.RadixCache: random scheduler-like traffic against a reference model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weft.radix import RadixCache, TreeNode

POOL_SLOTS = 24  # small, so requests often have to evict to get their slots
MAX_ACTIVE = 4

Prefix = tuple[int, ...]


class PagePool:
    """Fake KV allocator owning POOL_SLOTS slots in whole pages; checks every free() it receives."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = list(range(POOL_SLOTS // page_size))
        self.freed: list[int] = []  # slots received by free() since the last clear

    @property
    def free_slots(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Whole pages covering num_tokens: int64 [ceil(num_tokens / page_size) * page_size]."""
        n = -(-num_tokens // self.page_size)
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.pop() for _ in range(n)]
        return torch.tensor(
            [p * self.page_size + i for p in pages for i in range(self.page_size)],
            dtype=torch.int64,
        )

    def free(self, indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.dim() == 1
        got = indices.tolist()
        ps = self.page_size
        assert len(got) % ps == 0, f"free() of a partial page: {got}"
        for i in range(0, len(got), ps):
            start = got[i]
            assert start % ps == 0 and got[i : i + ps] == list(range(start, start + ps)), got
            assert start // ps not in self.free_pages, f"double free of page {start // ps}"
            self.free_pages.append(start // ps)
        self.freed += got

    def free_slot_set(self) -> set[int]:
        return {p * self.page_size + i for p in self.free_pages for i in range(self.page_size)}


class Reference:
    """Naive model: every cached page-aligned token prefix -> (KV slots of its last page, last access
    time). Prefixes are cached whole pages at a time, so [0, 0] and [0, 1] share no entry."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: dict[Prefix, list[int]] = {}
        self.time: dict[Prefix, int] = {}
        self.clock = 0

    def _cached_len(self, key: Prefix) -> int:
        n = 0
        while n < len(key) and key[: n + self.ps] in self.pages:
            n += self.ps
        return n

    def _touch(self, key: Prefix, n: int) -> None:
        self.clock += 1
        for i in range(self.ps, n + 1, self.ps):
            self.time[key[:i]] = self.clock

    def aligned(self, key: list[int]) -> Prefix:
        return tuple(key[: len(key) // self.ps * self.ps])

    def match(self, key: list[int]) -> list[int]:
        aligned = self.aligned(key)
        n = self._cached_len(aligned)
        self._touch(aligned, n)
        return [s for i in range(self.ps, n + 1, self.ps) for s in self.pages[aligned[:i]]]

    def insert(self, key: list[int], value: list[int]) -> int:
        aligned = self.aligned(key)
        n = self._cached_len(aligned)
        for i in range(n, len(aligned), self.ps):
            self.pages[aligned[: i + self.ps]] = value[i : i + self.ps]
        self._touch(aligned, len(aligned))
        return n

    def size(self) -> int:
        return len(self.pages) * self.ps

    def slots(self) -> list[int]:
        return [s for page in self.pages.values() for s in page]

    def leaves(self) -> set[Prefix]:
        parents = {p[: -self.ps] for p in self.pages}
        return {p for p in self.pages if p not in parents}


@dataclass
class Request:
    key: list[int]
    prefix: torch.Tensor  # slots from match_prefix, owned by the tree (locked)
    pages: torch.Tensor  # slots the request allocated for the rest of the key (whole pages)
    last_node: TreeNode


class Harness:
    """Drives a RadixCache the way the scheduler does and checks it against the reference."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pool = PagePool(page_size)
        self.cache = RadixCache(self.pool, page_size=page_size)
        self.ref = Reference(page_size)
        self.active: list[Request] = []

    def locked(self) -> Counter[Prefix]:
        """Page prefixes on the locked paths of active requests."""
        counts: Counter[Prefix] = Counter()
        for req in self.active:
            counts.update(tuple(req.key[:i]) for i in range(self.ps, len(req.prefix) + 1, self.ps))
        return counts

    # ------------------------------------------------------------------ operations

    def match(self, key: list[int]) -> None:
        result = self.cache.match_prefix(key)
        assert result.indices.tolist() == self.ref.match(key)
        path: list[int] = []
        node = result.last_node
        while node.parent is not None:
            path[:0] = node.key
            node = node.parent
        assert path == key[: len(result.indices)]

    def start(self, key: list[int]) -> None:
        """Admit a request: match and lock its prefix, allocate the rest (evicting if needed)."""
        if len(self.active) >= MAX_ACTIVE:
            return
        result = self.cache.match_prefix(key)
        assert result.indices.tolist() == self.ref.match(key)
        self.cache.inc_lock_ref(result.last_node)
        req = Request(key, result.indices, torch.empty(0, dtype=torch.int64), result.last_node)
        self.active.append(req)
        pages = self._alloc(len(key) - len(result.indices))
        if pages is None:
            self.active.pop()
            self.cache.dec_lock_ref(result.last_node)
            return
        req.pages = pages

    def finish(self, which: int) -> None:
        """A finished request inserts its tokens, frees what the tree already had, unlocks."""
        if not self.active:
            return
        req = self.active.pop(which % len(self.active))
        value = torch.cat([req.prefix, req.pages])[: len(req.key)]
        got = self.cache.insert(req.key, value)
        assert got == self.ref.insert(req.key, value.tolist())
        lp, aligned = len(req.prefix), len(req.key) // self.ps * self.ps
        assert got >= lp, "the locked prefix vanished"
        self.pool.free(value[lp:got])  # duplicates of what another request cached meanwhile
        self.pool.free(req.pages[aligned - lp :])  # the partial last page (and its unused slots)
        self.cache.dec_lock_ref(req.last_node)

    def abort(self, which: int) -> None:
        if not self.active:
            return
        req = self.active.pop(which % len(self.active))
        self.pool.free(req.pages)
        self.cache.dec_lock_ref(req.last_node)

    def insert_fresh(self, key: list[int]) -> None:
        """Insert with all-new slots (no match first): everything already cached is a duplicate."""
        pages = self._alloc(len(key))
        if pages is None:
            return
        got = self.cache.insert(key, pages[: len(key)])
        assert got == self.ref.insert(key, pages[: len(key)].tolist())
        self.pool.free(pages[:got])
        self.pool.free(pages[len(key) // self.ps * self.ps :])

    def evict(self, num_tokens: int) -> None:
        locked = self.locked()
        evictable_before = self.cache.evictable_size()
        assert evictable_before == self.ps * sum(1 for p in self.ref.pages if p not in locked)
        self.pool.freed = []
        freed = self.cache.evict(num_tokens)
        assert freed == len(self.pool.freed)
        assert freed >= num_tokens or self.cache.evictable_size() == 0
        assert freed <= evictable_before
        by_slot = {s: p for p, page in self.ref.pages.items() for s in page}
        evicted = {by_slot[s] for s in self.pool.freed}  # KeyError: a slot the tree didn't own
        assert sorted(self.pool.freed) == sorted(s for p in evicted for s in self.ref.pages[p])
        assert not [p for p in evicted if p in locked], "a locked prefix was evicted"
        for p in evicted:
            del self.ref.pages[p]
        # LRU: nothing evicted is newer than any unlocked leaf that survived.
        survivors = [self.ref.time[p] for p in self.ref.leaves() if p not in locked]
        if evicted and survivors:
            assert max(self.ref.time[p] for p in evicted) <= min(survivors)

    def reset(self) -> None:
        if self.cache.protected_size():
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.pool.freed = []
        self.cache.reset()
        assert sorted(self.pool.freed) == sorted(self.ref.slots())
        self.ref.pages.clear()

    def _alloc(self, num_tokens: int) -> torch.Tensor | None:
        pages = self.pool.alloc(num_tokens)
        if pages is None:
            shortfall = -(-num_tokens // self.ps) * self.ps - self.pool.free_slots
            self.evict(shortfall)
            pages = self.pool.alloc(num_tokens)
        return pages

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        cache, ref = self.cache, self.ref
        cache.check_integrity()
        locked = self.locked()
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert cache.total_size() == ref.size()
        assert cache.protected_size() == self.ps * len(locked)
        # the reference stays prefix-closed (eviction only ever removed leaves)
        assert all(p[: -self.ps] in ref.pages for p in ref.pages if len(p) > self.ps)
        # locked paths still map to the slots their requests were given
        for req in self.active:
            for i in range(0, len(req.prefix), self.ps):
                page = ref.pages[tuple(req.key[: i + self.ps])]
                assert page == req.prefix[i : i + self.ps].tolist()
        # conservation: every slot is free, in the tree, or held by a request; never two of them
        held = [s for req in self.active for s in req.pages.tolist()]
        assert self.pool.free_slots + cache.total_size() + len(held) == POOL_SLOTS
        free, in_tree = self.pool.free_slot_set(), set(ref.slots())
        assert len(in_tree) == ref.size() and len(set(held)) == len(held)
        assert free | in_tree | set(held) == set(range(POOL_SLOTS))


# op name -> weight (repeats) in the random traffic
OPS = ["match"] * 3 + ["start"] * 4 + ["finish"] * 2 + ["abort"] + ["insert_fresh"] * 3
OPS += ["evict"] * 3 + ["reset"]


@pytest.mark.parametrize("page_size", [1, 2, 4])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_radix_cache_matches_reference(page_size: int, data: st.DataObject) -> None:
    # Keys mostly extend a few shared stems, so prefixes collide (and split) even with 4-token pages.
    stem = st.lists(st.integers(0, 3), min_size=8, max_size=12)
    stems = data.draw(st.lists(stem, min_size=1, max_size=3), label="stems")
    keys = st.builds(
        lambda stem, cut, tail: (stem[:cut] + tail)[:12],
        st.sampled_from(stems),
        st.integers(0, 12),
        st.one_of(st.just([]), st.lists(st.integers(0, 3), max_size=6)),
    )
    h = Harness(page_size)
    for _ in range(data.draw(st.integers(1, 50), label="steps")):
        op = data.draw(st.sampled_from(OPS))
        if op in ("match", "start", "insert_fresh"):
            getattr(h, op)(data.draw(keys))
        elif op in ("finish", "abort"):
            getattr(h, op)(data.draw(st.integers(0, MAX_ACTIVE - 1)))
        elif op == "evict":
            h.evict(data.draw(st.integers(0, 16)))
        else:
            h.reset()
        h.check()
    while h.active:  # drain: everything unlocks, and then the whole tree is evictable
        h.finish(0)
        h.check()
    assert h.cache.protected_size() == 0
    h.evict(POOL_SLOTS)
    h.check()
    assert h.cache.total_size() == 0 and h.pool.free_slots == POOL_SLOTS
