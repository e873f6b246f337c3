"""Chunk reuse and publish: the two operations the fold asks of the cache.

* :meth:`ChunkReuse.reuse`: look a chunk up (the pool first, then the lower tiers) and copy its
  KV into a request's slots, K re-rotated from where it was computed (``canonical_start``) to
  where it now sits; the copy is read under a lock, so nothing evicts the chunk meanwhile.
* :meth:`ChunkReuse.publish`: copy a chunk computed position-independently into slots the
  store owns (evicting if needed) and index it; written through to the lower tiers too.

All KV goes through one :class:`~relaxkv_sglang.cache.sglang.pool_kv.PoolKV`; tier crossings through
:class:`~relaxkv_sglang.cache.sglang.tier_movement.TierMovement` (:class:`~relaxkv_sglang.cache.sglang.tier_movement.NoTierMovement` without lower tiers). A chunk computed while
another copy was already stored (two requests of a batch, or one that missed it at its fold)
is counted as a duplicate compute (docs/reliability.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from relaxkv_sglang.cache.chunk_store import ChunkStore
from relaxkv_sglang.cache.tiers import TierName
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
from relaxkv_sglang.cache.sglang.tier_movement import NoTierMovement, SlotAllocator, TierMovement


class ChunkReuse:
    """A chunk's KV into a request (reuse) and out of one (publish), module doc."""

    def __init__(self, chunks: ChunkStore, pool_kv: PoolKV,
                 movement: "TierMovement | NoTierMovement | None" = None) -> None:
        """chunks: the pool's chunk store; pool_kv: the pool's KV; movement: the lower tiers (None: none)."""
        self.chunks = chunks
        self.pool_kv = pool_kv
        self.movement = movement if movement is not None else NoTierMovement()
        self.duplicate_computes = 0  # miss chunks computed while another copy was already stored
        self.duplicate_compute_tokens = 0

    def reuse(self, namespace: Optional[str], tokens: Sequence[int], dst: torch.Tensor,
              position: int) -> Optional[TierName]:
        """Copy a cached chunk into a request's slots, K re-rotated to ``position``.

        Args:
            namespace: the tenant namespace (see ``plan.request_namespace``).
            tokens: the chunk's token ids (counted as a lookup).
            dst: int64 [len(tokens)] the request's slots for the chunk.
            position: where the chunk's first token sits in the request.
        Returns:
            On a hit (``dst`` now holds the chunk's KV) the tier it was served from:
            ``TierName.DEVICE``, or the lower tier a chunk was loaded from (at admission, or
            here when the pool lacks it); None on a miss.
        """
        key = self.movement.seen(namespace, tokens)
        entry = self.chunks.lookup(namespace, tokens)
        if entry is None:
            return self.movement.reuse_into(key, dst, position) if key is not None else None
        self.chunks.lock(entry)  # nothing may evict it while it is read
        try:
            self.pool_kv.copy(entry.slots, dst, position - entry.canonical_start)
        finally:
            self.chunks.unlock(entry)
        origin, entry.origin = entry.origin, None
        return origin or TierName.DEVICE

    def publish(self, namespace: Optional[str], tokens: Sequence[int], src: torch.Tensor, position: int,
                alloc: SlotAllocator) -> bool:
        """Copy a chunk computed position-independently into slots the chunk store owns.

        Args:
            namespace: the tenant namespace.
            tokens: the chunk's token ids.
            src: int64 [len(tokens)] the request's slots holding its KV.
            position: where it was computed (its canonical start).
            alloc: gives the store's new slots (evicting if needed).
        Returns:
            True if stored now; False if already held (another request of the batch
            published it) or no room even after eviction (a cache may skip an insert).
        """
        if self.chunks.peek(namespace, tokens) is not None:
            self.duplicate_computes += 1
            self.duplicate_compute_tokens += len(tokens)
            return False
        slots = alloc(len(tokens))
        if slots is not None:
            self.pool_kv.copy(src, slots, 0)
            self.chunks.insert(namespace, tokens, slots, canonical_start=position)
        # kept for restarts even when the pool had no room
        self.movement.write_through(namespace, tokens, src, position)
        return slots is not None
