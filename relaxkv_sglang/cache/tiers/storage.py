"""The storage interface every lower tier implements, shaped like SGLang's ``hicache_storage.HiCacheStorage``.

Keys are content keys (:meth:`~relaxkv_sglang.cache.chunk_key.ChunkKey.content_key`); unlike HiCache's
prefix-chained page keys, each names one whole chunk and ``batch_exists`` answers per key (no prefix
rule). What a distributed backend needs: ``docs/api.md`` (lower tiers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from relaxkv_sglang.cache.tiers.record import ChunkRecord

__all__ = ["ChunkStorage", "StoreUnavailable"]


class StoreUnavailable(Exception):
    """A store is down and reconnects on its own (:class:`~.reconnect.ReconnectingPageStore`): the
    caller answers a miss, counted ``unavailable``."""


class ChunkStorage(ABC):
    """Chunk records by content key, in batches (module doc)."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        """Each key's record, or None (a miss; a damaged entry is a miss)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        """Store each record; False where it was not (refused, no room, error)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """True if it was there."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters (cumulative) and current occupancy."""

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def get(self, key: str) -> Optional[ChunkRecord]:
        return self.batch_get([key])[0]

    def set(self, key: str, record: ChunkRecord) -> bool:
        return self.batch_set([key], [record])[0]

    def count_write_error(self) -> None:
        """A write raised on a background thread (:class:`~.writer.AsyncWriter`); default: not counted."""
