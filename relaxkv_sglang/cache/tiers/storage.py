"""The storage interface every lower tier implements, shaped like SGLang HiCache's backends.

``batch_exists`` / ``batch_get`` / ``batch_set`` over lists of string keys (a chunk's content key,
:meth:`~relaxkv_sglang.cache.chunk_key.ChunkKey.content_key`),
host-memory records (:class:`~.record.ChunkRecord`) in and out, plus ``delete`` and ``stats``
(the shape of ``hicache_storage.HiCacheStorage``). Unlike HiCache's prefix-chained page keys,
each key names one whole chunk and ``batch_exists`` answers per key (no prefix rule). A
distributed backend (Mooncake store, 3FS, Redis/Valkey) implements the same five methods; what
it needs is in ``docs/api.md`` (lower tiers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from relaxkv_sglang.cache.tiers.record import ChunkRecord

__all__ = ["ChunkStorage", "StoreUnavailable"]


class StoreUnavailable(Exception):
    """A store is down (not connected yet, lost, or a call past its time bound) and reconnects on its
    own (:class:`~.reconnect.ReconnectingPageStore`): the caller answers a miss, counted
    ``unavailable``, without asking it."""


class ChunkStorage(ABC):
    """Batch get/set/exists of chunk records by key (HiCache's storage backend shape, module doc)."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later get may still miss)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[Optional[ChunkRecord]]:
        """Each key's record, or None (a miss; a damaged entry is a miss)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], records: Sequence[ChunkRecord]) -> list[bool]:
        """Store each record; False where it was not stored (refused, no room, error)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove a key; True if it was there."""

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
