"""Chunk-tree and lower-tier counters on SGLang's /metrics (``--enable-metrics``): ``relaxkv:chunk_<name>``
and ``relaxkv:tier_<tier>_<name>``."""

from __future__ import annotations

from typing import Any, Optional

from relaxkv_sglang.cache.pool_index import PoolChunkIndexStats
from relaxkv_sglang.cache.tiers import LOWER_TIERS

class ChunkMetrics:
    """Chunk-tree counters, made in the scheduler process (SGLang's prometheus multiprocess mode lets
    the HTTP process collect them); every series carries ``labels`` (SGLang's ``model_name``)."""

    COUNTERS = ("lookups", "hits", "misses", "hit_tokens", "miss_tokens", "inserts", "evictions", "evicted_tokens")
    GAUGES = {"tokens_held": "KV tokens held by the chunk tree.", "entries": "Chunks held by the chunk tree."}

    def __init__(self, labels: Optional[dict[str, str]] = None) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = dict(labels or {})
        self._counter, self._gauge = Counter, Gauge
        self.counters = {name: self._new_counter(f"relaxkv:chunk_{name}",
                                                 f"Chunk tree {name.replace('_', ' ')} since start.")
                         for name in self.COUNTERS}
        self.gauges = {name: self._new_gauge(f"relaxkv:chunk_{name}", doc) for name, doc in self.GAUGES.items()}
        self.last = dict.fromkeys(self.COUNTERS, 0)
        self.tier_counters: dict = {}
        self.tier_gauges: dict = {}
        self.tier_last: dict = {}

    def _new_counter(self, name: str, doc: str) -> Any:
        counter = self._counter(name, doc, labelnames=list(self.labels))
        return counter.labels(**self.labels) if self.labels else counter

    def _new_gauge(self, name: str, doc: str) -> Any:
        gauge = self._gauge(name, doc, labelnames=list(self.labels), multiprocess_mode="mostrecent")
        return gauge.labels(**self.labels) if self.labels else gauge

    def publish(self, stats: PoolChunkIndexStats, tier_stats: Optional[dict] = None) -> None:
        """Advance the counters by the cumulative totals' growth since the last call; set the gauges."""
        for name, counter in self.counters.items():
            value = getattr(stats, name)
            if value > self.last[name]:
                counter.inc(value - self.last[name])
            self.last[name] = value
        for name, gauge in self.gauges.items():
            gauge.set(getattr(stats, name))
        for name, value in (tier_stats or {}).items():
            if name not in TIER_METRICS and not name.endswith(TIER_GAUGES):
                continue
            if name.endswith(TIER_GAUGES):
                gauge = self.tier_gauges.get(name)
                if gauge is None:
                    gauge = self.tier_gauges[name] = self._new_gauge(
                        f"relaxkv:{name}", f"Lower tier {name[5:].replace('_', ' ')}.")
                gauge.set(value)
                continue
            counter = self.tier_counters.get(name)
            if counter is None:
                counter = self.tier_counters[name] = self._new_counter(
                    f"relaxkv:{name}", f"Lower tier {name[5:].replace('_', ' ')} since start.")
            last = self.tier_last.get(name, 0)
            if value > last:
                counter.inc(value - last)
            self.tier_last[name] = value


# Lower-tier counters, and gauges (current occupancy).
TIER_METRICS = {f"tier_{tier}_{name}" for tier in LOWER_TIERS for name in (
    "hits", "misses", "loads", "loaded_tokens", "loaded_bytes", "load_seconds", "spills", "spilled_bytes",
    "rejected", "evictions", "evicted_bytes", "writes", "written_bytes", "write_errors", "corrupt", "foreign",
    "publish_dropped", "spill_rejected", "incomplete", "errors", "unavailable", "store_lost", "store_timeouts",
    "store_reconnect_attempts", "store_reconnects")}
TIER_GAUGES = ("_bytes_held", "_entries", "_pending_writes", "_store_connected")
