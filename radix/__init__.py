"""weft.radix: the radix-tree prefix cache (pure CPU data structure)."""

from __future__ import annotations

from weft.radix.base import KVAllocator, MatchResult, PrefixCache, TreeNode
from weft.radix.cache import NoCache, RadixCache

__all__ = ["KVAllocator", "MatchResult", "NoCache", "PrefixCache", "RadixCache", "TreeNode"]
