"""Prefix-cache interface: the injected KV allocator, tree nodes, match results and the cache ABC."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch


class KVAllocator(Protocol):
    """Owner of the KV slot pool; the cache hands slots back to it when it drops them."""

    def free(self, indices: torch.Tensor) -> None:
        """Take back int64 [N] slot indices (whole, page-aligned pages when page_size > 1)."""
        ...


class TreeNode:
    """One edge of the radix tree: a run of tokens (`key`) and the KV slots holding them (`value`)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time")

    def __init__(
        self,
        key: tuple[int, ...] = (),
        value: torch.Tensor | None = None,
        parent: TreeNode | None = None,
    ) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}  # keyed by each child's first page
        self.parent = parent  # None only for a root
        self.key = key
        self.value = (
            torch.empty(0, dtype=torch.int64) if value is None else value
        )  # int64 [len(key)]
        self.lock_ref = 0  # requests using this node or a descendant; > 0 means never evicted
        self.last_access_time = 0  # the cache's logical clock at the last match/insert through here

    def __lt__(self, other: TreeNode) -> bool:  # eviction heap: least recently used first
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return (
            f"TreeNode(len={len(self.key)}, children={len(self.children)}, "
            f"lock_ref={self.lock_ref}, t={self.last_access_time})"
        )


class MatchResult(NamedTuple):
    indices: torch.Tensor  # int64 [L] KV slots of the matched prefix; L is a multiple of page_size
    last_node: (
        TreeNode  # deepest matched node, ending exactly at L; lock it while the slots are used
    )


class PrefixCache(ABC):
    """A map from token-id prefixes to the KV slots that hold them.

    Ownership: slots inside the cache belong to it and go back to the allocator only through `evict`
    or `reset`. Slots a caller passes to `insert` beyond the returned prefix length become the
    cache's; the rest stay the caller's to free (except those it got from `match_prefix`). Keys are
    only ever stored and matched in whole pages of `page_size` tokens.
    """

    page_size: int

    @abstractmethod
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key`, and the node it ends at (root if empty)."""

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache `key` -> `value` (int64 [len(key)]), truncated to whole pages.

        Returns how many leading tokens of the truncated key were already cached: the cache takes
        `value[returned:aligned_len]` and the caller keeps the rest. Raises ValueError if the value
        is not an int64 [len(key)] tensor.
        """

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Drop least-recently-used unlocked leaves until `num_tokens` are freed or none is left;
        returns the number of tokens whose slots went back to the allocator."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (one reference per call)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one reference taken by `inc_lock_ref(node)`."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens in locked nodes."""

    @abstractmethod
    def total_size(self) -> int:
        """All tokens in the cache (evictable + protected)."""

    @abstractmethod
    def values_by_age(self) -> list[torch.Tensor]:
        """Every node's value (KV slots), least recently used node first."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Recount the whole structure; raise RuntimeError with the numbers on any mismatch."""

    @abstractmethod
    def reset(self) -> None:
        """Free everything through the allocator; RuntimeError if anything is still locked."""
