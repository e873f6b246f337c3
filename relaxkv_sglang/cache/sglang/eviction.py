"""One eviction order over the radix tree's leaves and the pool's chunk index's entries.

Each victim is the older by last use of the strategy's next leaf and the index's LRU entry (leaf
first on a tie); both use ``time.monotonic``, so this is one LRU order over both trees.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from relaxkv_sglang.cache.pool_index import ChunkEntry, PoolChunkIndex

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import TreeNode


class EvictionOrder:
    """The next victim of one eviction, radix leaf or chunk (module doc)."""

    def __init__(self, leaves: Iterable[TreeNode], priority: Callable[[TreeNode], Any], chunks: PoolChunkIndex) -> None:
        """``priority``: the radix eviction strategy's rank of a leaf (any comparable), lowest first."""
        self.priority = priority
        self.chunks = chunks
        self._seq = itertools.count()  # ties in priority keep insertion order (nodes need not compare)
        self._heap = [(priority(leaf), next(self._seq), leaf) for leaf in leaves]
        heapq.heapify(self._heap)

    def push_leaf(self, leaf: TreeNode) -> None:
        """A node became an evictable leaf (its last child was evicted)."""
        heapq.heappush(self._heap, (self.priority(leaf), next(self._seq), leaf))

    def next(self) -> Optional[Union[TreeNode, ChunkEntry]]:
        """The next victim: a radix leaf (taken off the heap) or the oldest unlocked chunk
        (the caller evicts it from the index); None when neither tree has one."""
        entry = self.chunks.oldest()
        if not self._heap:
            return entry
        leaf = self._heap[0][2]
        if entry is None or leaf.last_access_time <= entry.last_access:
            heapq.heappop(self._heap)
            return leaf
        return entry
