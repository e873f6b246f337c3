"""Chunk reuse and publish: the two operations the fold asks of the cache."""

from __future__ import annotations

from typing import Optional

import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import PoolChunkIndex
from relaxkv_sglang.cache.tiers import TierName
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
from relaxkv_sglang.cache.sglang.tier_movement import NoTierMovement, SlotAllocator, TierMovement


class ChunkReuse:
    """A chunk's KV into a request (reuse) and out of one (publish)."""

    def __init__(self, chunks: PoolChunkIndex, pool_kv: PoolKV,
                 movement: "TierMovement | NoTierMovement | None" = None) -> None:
        """``movement``: the lower tiers (None: none)."""
        self.chunks = chunks
        self.pool_kv = pool_kv
        self.movement = movement if movement is not None else NoTierMovement()
        self.duplicate_computes = 0  # miss chunks computed while another copy was already stored
        self.duplicate_compute_tokens = 0

    def reuse(self, key: ChunkKey, dst: torch.Tensor, position: int) -> Optional[TierName]:
        """Copy a cached chunk (pool first, then lower tiers) into ``dst`` (int64 [len(key.tokens)]), K
        re-rotated to ``position``; the tier it came from (``DEVICE``, or where it was loaded from), None on a miss."""
        self.movement.seen(key)
        entry = self.chunks.lookup(key)
        if entry is None:
            return self.movement.reuse_into(key, dst, position)
        self.chunks.lock(entry)  # nothing may evict it while it is read
        try:
            self.pool_kv.copy(entry.slots, dst, position - entry.canonical_start)
        finally:
            self.chunks.unlock(entry)
        origin, entry.origin = entry.origin, None
        return origin or TierName.DEVICE

    def publish(self, key: ChunkKey, src: torch.Tensor, position: int, alloc: SlotAllocator) -> bool:
        """Copy a chunk computed at ``position`` in slots ``src`` (int64 [len(key.tokens)]) into slots from
        ``alloc``; False if already held (counted as a duplicate compute) or no room."""
        n = len(key.tokens)
        if self.chunks.peek(key) is not None:
            self.duplicate_computes += 1
            self.duplicate_compute_tokens += n
            return False
        slots = alloc(n)
        if slots is not None:
            self.pool_kv.copy(src, slots, 0)
            self.chunks.insert(key, slots, canonical_start=position)
        # kept for restarts even when the pool had no room
        self.movement.write_through(key, src, position)
        return slots is not None
