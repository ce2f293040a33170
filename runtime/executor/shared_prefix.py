"""Shared-prefix groups of a decode batch: requests whose KV begins with the same radix-tree slots."""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.runtime.scheduler.request import Req

MIN_SHARED_TOKENS = 256  # shorter shared prefixes are cheaper read per request
MEMBERS_PER_BLOCK = 16  # requests whose queries one attention program takes over the prefix
BLOCKS_PER_REQUESTS = 8  # at most one block per 8 requests of the batch (see max_blocks)
PREFIX_SPLITS = 4  # splits of a block's prefix (H200 sweep: 4 beat 8 and 16 at 4 and 16 groups)
# programs of the prefix kernel worth having (H200, fp8, 64 blocks of 2048 x 8 kv heads: 1 split
# 353 us, 2 splits 380, 4 splits 430, both kernels)
PREFIX_PROGRAMS = 512


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Which requests of a decode batch read a shared prefix once, as one block of members.

    Request b with kv_starts[b] > 0 walks only its own KV [kv_starts[b], seq_len); the first
    kv_starts[b] positions come from the one block listing b, whose block_lens equals it and whose
    block_rows is a table row holding the same slots there. A group of more than
    MEMBERS_PER_BLOCK members spans several blocks (block_members padded with -1).
    """

    kv_starts: list[int]  # per request of the batch
    block_members: list[list[int]]  # batch indices, each list MEMBERS_PER_BLOCK long, -1 padded
    block_rows: list[int]
    block_lens: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.block_lens)


def plan_shared_prefixes(
    reqs: list[Req],
    min_tokens: int = MIN_SHARED_TOKENS,
    members_per_block: int = MEMBERS_PER_BLOCK,
    block_limit: int | None = None,
) -> SharedPrefixPlan | None:
    """Group the requests by the deepest radix node that at least two of them lie under.

    A request's KV row starts with the slots of the tree path down to its locked node
    (`req.last_node`, covering `req.prefix_len` tokens), so two requests under the same node share
    the slots of every position before that node's end. Each request joins the group of the deepest
    node on its path shared with another request of the batch, if that node ends at least
    `min_tokens` in. The groups that save the most prefix reads get blocks first, up to
    `block_limit` blocks (default `max_blocks(len(reqs))`); the rest read their prefix per request.
    None when no group gets a block (or no request has a tree path: caching off).
    """
    paths: list[list[tuple[Any, int]]] = []  # per request: (node, its end in tokens), deepest first
    under: dict[int, int] = defaultdict(int)  # id(node) -> requests of the batch under it
    for req in reqs:
        nodes = []
        node = req.last_node
        while node is not None and node.parent is not None:  # the root (parent None) is skipped
            nodes.append(node)
            node = node.parent
        path, end = [], req.prefix_len
        for node in nodes:
            path.append((node, end))
            under[id(node)] += 1
            end -= len(node.key)
        # NOTE: the path always covers exactly the locked prefix; if it ever did not, the
        # request reads its whole KV itself rather than trusting the tree
        paths.append(path if end == 0 else [])
    groups: dict[int, list[int]] = defaultdict(list)
    lens: dict[int, int] = {}
    for b, path in enumerate(paths):
        for node, end in path:
            if under[id(node)] >= 2:
                if end >= min_tokens:
                    groups[id(node)].append(b)
                    lens[id(node)] = end
                break
    limit = max_blocks(len(reqs)) if block_limit is None else block_limit
    # prefix tokens not re-read, per group: the biggest savings get blocks first
    # (ties go to the group whose first request comes first: the same plan on every TP rank)
    saved = sorted(
        (-(len(m) - 1) * lens[key], m[0], key) for key, m in groups.items() if len(m) > 1
    )
    kv_starts = [0] * len(reqs)
    block_members: list[list[int]] = []
    block_rows: list[int] = []
    block_lens: list[int] = []
    for _, _, key in saved:
        members = groups[key]
        if len(block_lens) + -(-len(members) // members_per_block) > limit:
            continue
        for b in members:
            kv_starts[b] = lens[key]
        for first in range(0, len(members), members_per_block):
            chunk = members[first : first + members_per_block]
            block_members.append(chunk + [-1] * (members_per_block - len(chunk)))
            row = reqs[chunk[0]].row
            assert row is not None
            block_rows.append(row)
            block_lens.append(lens[key])
    if not block_lens:
        return None
    return SharedPrefixPlan(kv_starts, block_members, block_rows, block_lens)


class PlanCache:
    """The last decode batch's plan, reused while the batch is the same requests in the same order
    with the same table rows, locked nodes and prefix lengths (a steady decode: only the
    requests' own tokens change, and the plan does not depend on them).

    The slots of a locked path are never evicted, and a split of a node on a path (another
    request's insert) keeps the lower half's identity: every request keeps its deepest shared
    node and that node's end, so the plan stays what `plan_shared_prefixes` would return.
    """

    def __init__(self) -> None:
        self.hits = 0
        self._reqs: list[Req] = []
        self._key: tuple[list[Any], list[int], list[int | None]] = ([], [], [])
        self._plan: SharedPrefixPlan | None = None

    def plan(self, reqs: list[Req]) -> SharedPrefixPlan | None:
        """plan_shared_prefixes(reqs), from the cache when nothing it depends on has changed."""
        nodes = [r.last_node for r in reqs]
        key = (nodes, [r.prefix_len for r in reqs], [r.row for r in reqs])
        old_nodes, old_lens, old_rows = self._key
        if (
            len(reqs) == len(self._reqs)
            and all(map(operator.is_, reqs, self._reqs))
            and all(map(operator.is_, nodes, old_nodes))
            and key[1] == old_lens
            and key[2] == old_rows
        ):
            self.hits += 1
            return self._plan
        self._plan = plan_shared_prefixes(reqs)
        self._reqs, self._key = list(reqs), key
        return self._plan

    def clear(self) -> None:
        """Forget the last batch (and let go of its requests)."""
        self._reqs, self._key, self._plan = [], ([], [], []), None


def prefix_splits(prefix_len: int, num_blocks: int, num_kv_heads: int) -> int:
    """Splits of each of `num_blocks` blocks' prefixes of (at most) prefix_len tokens: enough for
    about PREFIX_PROGRAMS programs in all, at most PREFIX_SPLITS, at least 256 tokens each."""
    enough = -(-PREFIX_PROGRAMS // max(1, num_blocks * num_kv_heads))
    return max(1, min(PREFIX_SPLITS, prefix_len // 256, enough))


def max_blocks(batch_size: int) -> int:
    """The most blocks a plan for `batch_size` requests has. In CUDA graphs the prefix kernel runs
    a program per possible block, and empty ones cost time too: at most one per 8 requests."""
    return max(1, batch_size // BLOCKS_PER_REQUESTS)
