"""Writes to a slow tier on one background thread, so the scheduler thread never waits on fsync.

The queue is bounded in bytes, so memory stays bounded under a burst of publishes: a write that does
not fit is dropped and counted. A write that raises is counted by its storage
(:meth:`~.storage.ChunkStorage.count_write_error`), never taking the server down.
"""

from __future__ import annotations

import queue
import threading

from relaxkv_sglang.cache.tiers.record import ChunkRecord
from relaxkv_sglang.cache.tiers.storage import ChunkStorage

__all__ = ["AsyncWriter"]


class AsyncWriter:
    def __init__(self, storage: ChunkStorage, max_queued_bytes: int = 256 << 20) -> None:
        self.storage = storage
        self.max_queued_bytes = int(max_queued_bytes)
        self.queued_bytes = 0
        self.pending_keys: set[str] = set()
        self.dropped = 0
        self.cond = threading.Condition()
        self.q: "queue.Queue[tuple[str, ChunkRecord] | None]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="relaxkv-chunk-writer", daemon=True)
        self.thread.start()

    def submit(self, key: str, record: ChunkRecord) -> bool:
        """Queue a write; False (dropped, counted) if the queue is full; True if already queued."""
        with self.cond:
            if key in self.pending_keys:
                return True
            if self.queued_bytes + record.nbytes > self.max_queued_bytes:
                self.dropped += 1
                return False
            self.queued_bytes += record.nbytes
            self.pending_keys.add(key)
        self.q.put((key, record))
        return True

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            key, record = item
            try:
                self.storage.set(key, record)
            except Exception:  # noqa: BLE001 - a write never takes the server down; counted
                self.storage.count_write_error()
            finally:
                with self.cond:
                    self.queued_bytes -= record.nbytes
                    self.pending_keys.discard(key)
                    self.cond.notify_all()

    def pending(self) -> int:
        with self.cond:
            return len(self.pending_keys)

    def is_pending(self, key: str) -> bool:
        with self.cond:
            return key in self.pending_keys

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.pending_keys, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        self.drain(timeout)
        self.q.put(None)
