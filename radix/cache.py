"""RadixCache (token prefixes -> KV slots, LRU eviction, lock refs) and NoCache (caching off)."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import torch

from weft.radix.base import KVAllocator, MatchResult, PrefixCache, TreeNode


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _check_value(key: Sequence[int], value: torch.Tensor) -> None:
    if value.dtype != torch.int64 or value.dim() != 1 or len(value) != len(key):
        raise ValueError(
            f"value must be an int64 [len(key)={len(key)}] tensor, "
            f"got {value.dtype} {list(value.shape)}"
        )


class RadixCache(PrefixCache):
    """Radix tree over token ids whose nodes hold the KV slots of their tokens.

    NOTE: invariants (verified by `check_integrity`):
    - every non-root node has 0 < len(key) == len(value), a multiple of page_size, and is stored in
      its parent's `children` under its first page;
    - lock_ref(node) >= sum of its children's lock_ref (a lock covers a node and all its ancestors);
    - evictable/protected sizes are the token counts of unlocked/locked nodes, kept incrementally;
    - no KV slot appears twice in the tree.
    """

    def __init__(self, allocator: KVAllocator | None, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator  # None: evicted values are simply dropped (unit tests)
        self.page_size = page_size
        self.root_node = TreeNode()
        self._evictable = 0
        self._protected = 0
        self._clock = 0  # logical time: +1 per match_prefix / insert

    ##### Public API #####

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        node, _, values = self._walk(self._aligned(key))
        return MatchResult(torch.cat(values) if values else _empty(), node)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        _check_value(key, value)
        aligned = self._aligned(key)
        node, matched, _ = self._walk(aligned)
        if matched < len(aligned):
            # NOTE: clone so a caller reusing its buffer (e.g. a req-to-token row) can't alter the tree.
            leaf = TreeNode(aligned[matched:], value[matched : len(aligned)].clone(), node)
            leaf.last_access_time = self._clock
            node.children[self._page(leaf.key)] = leaf
            self._evictable += len(leaf.key)
        return matched

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._page(node.key)]
            self._free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            # NOTE: every walk stamps its whole path, so a parent is never older than its
            # children: pushing it keeps the pops in LRU order.
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, f"dec_lock_ref below zero at {node}"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def values_by_age(self) -> list[torch.Tensor]:
        return [n.value for n in sorted(self._nodes(), key=lambda n: n.last_access_time)]

    def check_integrity(self) -> None:
        errors: list[str] = []
        evictable = protected = 0
        slots: list[torch.Tensor] = []
        for node in self._nodes():
            n, where = len(node.key), repr(node)
            parent = node.parent
            if parent is None or parent.children.get(self._page(node.key)) is not node:
                errors.append(f"{where} is not its parent's child under its first page")
            if n == 0 or n % self.page_size:
                errors.append(f"{where}: key length {n} is not a positive multiple of page_size")
            if tuple(node.value.shape) != (n,):
                errors.append(f"{where}: value shape {list(node.value.shape)} != key length {n}")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < 0 or node.lock_ref < child_locks:
                errors.append(
                    f"{where}: lock_ref {node.lock_ref} < 0 or < children's {child_locks}"
                )
            if node.lock_ref > 0:
                protected += n
            else:
                evictable += n
            slots.append(node.value)
        if self.root_node.parent is not None or self.root_node.key:
            errors.append("root has a parent or a key")
        all_slots = torch.cat(slots) if slots else _empty()
        unique = int(torch.unique(all_slots).numel())
        if unique != all_slots.numel():
            errors.append(f"{all_slots.numel() - unique} duplicate KV slots in the tree")
        if (evictable, protected) != (self._evictable, self._protected):
            errors.append(
                f"sizes: counted evictable={evictable} protected={protected}, "
                f"tracked evictable={self._evictable} protected={self._protected}"
            )
        if errors:
            raise RuntimeError("radix cache integrity check failed: " + "; ".join(errors[:8]))

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} locked tokens in the radix cache")
        for node in self._nodes():
            self._free(node.value)
        # NOTE: keep the root object: requests may still hold it as their (empty-match) last_node.
        self.root_node.children = {}
        self._evictable = 0

    ##### Internal Helper Functions #####

    def _aligned(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: len(key) // self.page_size * self.page_size])

    def _page(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[: self.page_size]

    def _walk(self, key: tuple[int, ...]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` (page-aligned) down from the root as far as it is cached, splitting the last
        node so the match ends on a node boundary and stamping the path as just used.
        Returns (deepest matched node, matched length, the matched nodes' values)."""
        self._clock += 1
        node = self.root_node
        node.last_access_time = self._clock
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + self.page_size])
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = self._clock
            values.append(child.value)
            pos += n
            node = child
        return node, pos, values

    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of node_key and key[pos:], in whole pages."""
        n = len(node_key)
        if key[pos : pos + n] == node_key:  # fast path: the whole node matches
            return n
        ps, i = self.page_size, 0
        while i < n and key[pos + i : pos + i + ps] == node_key[i : i + ps]:
            i += ps
        return i

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut `node` after its first n tokens; returns the new upper part (node keeps the tail).
        The caller stamps the upper part's access time: it is always on the path being walked."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node.key) and n % self.page_size == 0
        upper = TreeNode(node.key[:n], node.value[:n], parent)
        upper.lock_ref = node.lock_ref  # same requests hold both halves: sizes don't change
        parent.children[self._page(upper.key)] = upper
        node.key, node.value, node.parent = node.key[n:], node.value[n:], upper
        upper.children[self._page(node.key)] = node
        return upper

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root (depth-first)."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _free(self, value: torch.Tensor) -> None:
        if self.allocator is not None:
            self.allocator.free(value)


class NoCache(PrefixCache):
    """Caching off (--disable-radix-cache): nothing is kept, every request prefills in full."""

    def __init__(self, allocator: KVAllocator | None = None, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root_node = TreeNode()  # sentinel last_node of every match; lock ops ignore it

    ##### Public API #####

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        return MatchResult(_empty(), self.root_node)

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        _check_value(key, value)
        return len(key) // self.page_size * self.page_size  # "all already cached": caller frees all

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def values_by_age(self) -> list[torch.Tensor]:
        return []

    def check_integrity(self) -> None:
        pass

    def reset(self) -> None:
        pass
