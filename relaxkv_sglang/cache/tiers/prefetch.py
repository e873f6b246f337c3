"""Reads of prefetchable tiers started ahead of the load, on a background thread, so they overlap the
running batch (:meth:`~.store.TieredChunkStore.prefetch`, each admission round).

Past ``max_bytes`` the oldest staged record is dropped (counted, read again at the load); a load of a
key being read waits for it. A staged read's time is counted in ``load_seconds`` when it is used.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from relaxkv_sglang.cache.tiers.record import ChunkRecord
from relaxkv_sglang.cache.tiers.tier import Tier

__all__ = ["PrefetchStage", "StagedRead"]

# (tier name, event) -> counted by the store: "prefetched" or "prefetch_dropped"
CountEvent = Callable[[str, str], None]


class StagedRead:
    """One prefetched record: what was read, from which tier, and how long the read took."""

    __slots__ = ("record", "tier", "seconds")

    def __init__(self, record: ChunkRecord, tier: str, seconds: float) -> None:
        self.record, self.tier, self.seconds = record, tier, seconds


class PrefetchStage:
    def __init__(self, max_bytes: int, count: CountEvent) -> None:
        """``count`` is called under the lock."""
        self.staged: OrderedDict[str, StagedRead] = OrderedDict()
        self.staged_bytes = 0
        self.max_bytes = max_bytes
        self.inflight: set[str] = set()
        self.lock = threading.Condition()
        self.q: "queue.Queue[tuple[str, Tier] | None]" = queue.Queue()
        self.thread: threading.Thread | None = None
        self.count = count

    def wants(self, key: str) -> bool:
        """Whether ``key`` may be queued: not staged, not being read, and the stage not full."""
        with self.lock:
            return key not in self.staged and key not in self.inflight and self.staged_bytes < self.max_bytes

    def queue(self, key: str, tier: Tier) -> None:
        """Read ``key`` from ``tier`` on the thread (started on first use)."""
        with self.lock:
            self.inflight.add(key)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="relaxkv-chunk-prefetch", daemon=True)
            self.thread.start()
        self.q.put((key, tier))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            key, tier = item
            t0 = time.perf_counter()
            try:
                record = tier.get(key)
            except Exception:  # noqa: BLE001 - a failed prefetch is just not staged
                record = None
            seconds = time.perf_counter() - t0
            with self.lock:
                self.inflight.discard(key)
                self.lock.notify_all()
                if record is not None:
                    self._stage(key, StagedRead(record, tier.name, seconds))

    def _stage(self, key: str, read: StagedRead) -> None:
        self.staged[key] = read
        self.staged_bytes += read.record.nbytes
        self.count(read.tier, "prefetched")
        while self.staged_bytes > self.max_bytes and self.staged:
            _, old = self.staged.popitem(last=False)
            self.staged_bytes -= old.record.nbytes
            self.count(old.tier, "prefetch_dropped")

    def take(self, key: str, wait_s: float = 5.0) -> Optional[StagedRead]:
        """The staged read of ``key``, removed from the stage; a read under way is waited for."""
        with self.lock:
            self.lock.wait_for(lambda: key not in self.inflight, wait_s)
            read = self.staged.pop(key, None)
            if read is not None:
                self.staged_bytes -= read.record.nbytes
            return read

    def bytes_from(self, tier: str) -> int:
        with self.lock:
            return sum(r.record.nbytes for r in self.staged.values() if r.tier == tier)

    def clear(self) -> None:
        with self.lock:
            self.staged.clear()
            self.staged_bytes = 0

    def close(self) -> None:
        if self.thread is not None:
            self.q.put(None)
