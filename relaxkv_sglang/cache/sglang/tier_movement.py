"""Chunk KV moving between the KV pool and the lower tiers: spill, load, write-through, prefetch.

A lower tier never fails a request: an exception is logged and counted (``tier_errors``) and the
chunk is a miss.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import ChunkEntry, PoolChunkIndex
from relaxkv_sglang.cache.tiers import TieredChunkStore, TierName
from relaxkv_sglang.cache.sglang.pins import requests_chunks
from relaxkv_sglang.runtime import records
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from relaxkv_sglang.cache.tiers import ChunkRecord

logger = logging.getLogger(__name__)

# Allocates n pool slots for a chunk (int64 [n]), evicting what it may; None if no room.
SlotAllocator = Callable[[int], Optional[torch.Tensor]]


class PrefetchStarted:
    """A ``Req``'s record: the reads of its chunks the pool lacks were started (once per request)."""


class TierMovement:
    def __init__(self, tiers: TieredChunkStore, pool_kv: PoolKV) -> None:
        self.tiers = tiers
        self.pool_kv = pool_kv
        self.load_no_room = 0  # lower-tier hits not loaded at admission: no free slots
        self.errors = 0  # spills / loads / writes that raised (logged; the chunk is then a miss)
        self.wrong_size = 0  # records whose token count is not the chunk's (never written into the pool)

    def seen(self, key: ChunkKey) -> None:
        """A chunk lookup happened: the tiers' admission counts it."""
        self.tiers.record_access(key)

    def spill(self, entry: ChunkEntry) -> None:
        """The pool's index evicts ``entry``: keep its KV in a lower tier (while its slots hold it)."""
        try:
            tier = self.tiers.spill_wanted(entry.key)
            if tier is not None:
                self.tiers.spill(entry.key, self.pool_kv.read(entry.slots, entry.canonical_start), tier)
        except Exception:  # noqa: BLE001 - eviction must go on; the chunk is just gone
            logger.exception("relaxkv: spilling an evicted chunk failed")
            self.errors += 1

    def load(self, chunks: PoolChunkIndex, key: ChunkKey, alloc: SlotAllocator) -> Optional[ChunkEntry]:
        """A chunk loaded from the fastest lower tier holding it into slots from ``alloc`` and inserted
        into ``chunks`` (unlocked, ``origin`` its tier until its first hit); None if absent, damaged or no room."""
        if self.tiers.where(key) is None:
            return None
        try:
            record, tier = self.tiers.get(key)
            if record is None or not self._fits(record, len(key.tokens)):  # damaged: counted by the tier
                return None
            slots = alloc(len(key.tokens))
            if slots is None:
                self.load_no_room += 1
                return None
            self.pool_kv.write(slots, record)
        except Exception:  # noqa: BLE001
            logger.exception("relaxkv: loading a chunk from a lower tier failed; computing it")
            self.errors += 1
            return None
        entry = chunks.insert(key, slots, canonical_start=record.canonical_start)
        entry.origin = tier
        self.tiers.taken(key, tier)  # an exclusive tier gives its copy up
        return entry

    def _fits(self, record: ChunkRecord, n_tokens: int) -> bool:
        """Whether a loaded record holds ``n_tokens`` (else a counted miss: a value under another chunk's key)."""
        if record.n_tokens == n_tokens:
            return True
        self.wrong_size += 1
        logger.warning("relaxkv: a lower tier's record has %d tokens for a chunk of %d; computing it",
                       record.n_tokens, n_tokens)
        return False

    def reuse_into(self, key: ChunkKey, dst: torch.Tensor, position: int) -> Optional[TierName]:
        """A pool miss from a lower tier into ``dst`` (int64 [n]), K re-rotated to ``position``; its tier or None."""
        try:
            record, tier = self.tiers.get(key)
            if record is None or not self._fits(record, len(dst)):
                return None
            self.pool_kv.write(dst, record, position - record.canonical_start)
        except Exception:  # noqa: BLE001 - a lower tier never fails a request: it is a miss
            logger.exception("relaxkv: loading a chunk from a lower tier failed; computing it")
            self.errors += 1
            return None
        return tier

    def write_through(self, key: ChunkKey, src: torch.Tensor, position: int) -> None:
        """A chunk computed at ``position`` in slots ``src`` (int64 [n]) to the write-through tiers lacking it."""
        if not self.tiers.publish_wanted(key):
            return
        try:
            self.tiers.publish(key, self.pool_kv.read(src, position))
        except Exception:  # noqa: BLE001
            logger.exception("relaxkv: writing a chunk to disk failed")
            self.errors += 1

    def prefetch(self, chunks: PoolChunkIndex, waiting: Iterable[Req]) -> None:
        """Start the reads of the chunks the pool lacks of each newly queued request (once per request)."""
        if not self.tiers.can_prefetch:
            return
        keys = []
        for req in waiting:
            if records.record(req, PrefetchStarted, create=False) is not None:
                continue
            records.attach(req, PrefetchStarted())
            keys += [key for key in requests_chunks([req]) if chunks.peek(key) is None]
        if keys:
            self.tiers.prefetch(keys)

    def clear(self) -> None:
        """A flush: the exclusive tiers and staged reads go; write-through tiers stay (what a restart serves)."""
        self.tiers.clear_exclusive()
        self.tiers.clear_staged()

    def names(self) -> list[TierName]:
        """The lower tiers, fastest first."""
        return list(self.tiers.names)

    def tier_stats(self) -> dict:
        """The tiers' own counters (the /metrics exporter's)."""
        return self.tiers.stats()

    def stats(self) -> dict:
        """The tiers' counters and this movement's own, for /get_server_info."""
        return {**self.tiers.stats(), "tier_load_no_room": self.load_no_room, "tier_errors": self.errors,
                "tier_wrong_size": self.wrong_size}


class NoTierMovement:
    """:class:`TierMovement` for a cache without lower tiers: nothing moves, nothing is counted."""

    def seen(self, key: ChunkKey) -> None:
        """No tier counts lookups."""

    def spill(self, entry: ChunkEntry) -> None:
        """No tier to keep an evicted chunk."""

    def load(self, chunks: PoolChunkIndex, key: ChunkKey, alloc: SlotAllocator) -> Optional[ChunkEntry]:
        """No tier to load from."""
        return None

    def reuse_into(self, key: ChunkKey, dst: torch.Tensor, position: int) -> None:
        """No tier to serve a pool miss."""
        return None

    def write_through(self, key: ChunkKey, src: torch.Tensor, position: int) -> None:
        """No tier to write to."""

    def prefetch(self, chunks: PoolChunkIndex, waiting: Iterable[Req]) -> None:
        """No tier to read ahead from."""

    def clear(self) -> None:
        """Nothing held."""

    def names(self) -> list[TierName]:
        """No lower tier."""
        return []

    def tier_stats(self) -> None:
        """No tier counters (the /metrics exporter skips them)."""
        return None

    def stats(self) -> dict:
        """No counters."""
        return {}
