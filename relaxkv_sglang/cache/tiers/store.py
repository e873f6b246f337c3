"""The lower tiers together, for the server: an ordered list of tiers, fastest first, each used by its
role (:mod:`.tier`); nothing here names a tier.

The server names chunks by :class:`~relaxkv_sglang.cache.chunk_key.ChunkKey`; the tiers are asked
under its content key, salted with the model identity. A chunk the pool evicts goes to the first
exclusive tier whose admission takes it (asked before its KV leaves the pool), else to the first
write-through tier lacking it. ``stats``: flat counters ``tier_<name>_<counter>``, each tier's own
and the store's, by the tier's role.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers.keys import ModelIdentity
from relaxkv_sglang.cache.tiers.names import TierName
from relaxkv_sglang.cache.tiers.prefetch import PrefetchStage
from relaxkv_sglang.cache.tiers.record import ChunkRecord
from relaxkv_sglang.cache.tiers.tier import Tier
from relaxkv_sglang.cache.tiers.writer import AsyncWriter

__all__ = ["TieredChunkStore"]


def _store_counters(tier: Tier) -> dict:
    """The store's counters of one tier, by its role (module doc)."""
    counters = dict(loads=0, loaded_tokens=0, loaded_bytes=0, load_seconds=0.0)
    if tier.role.exclusive:
        counters.update(spills=0, spilled_bytes=0, spill_rejected=0)
    if tier.role.write_through:
        counters.update(spills=0, publishes=0, publish_dropped=0)
    if tier.role.prefetchable:
        counters.update(prefetched=0, prefetch_used=0, prefetch_dropped=0)
    return counters


class TieredChunkStore:
    """The lower tiers, for the server: a chunk evicted from the device spills to a host tier and loads back:

    >>> import torch
    >>> from relaxkv_sglang.cache.chunk_key import ChunkKey
    >>> from relaxkv_sglang.cache.tiers import ChunkRecord, HostTier, ModelIdentity
    >>> identity = ModelIdentity(model="m", tokenizer="t", kv_dtype="float32", kv_layout="2x1x4")
    >>> store = TieredChunkStore([HostTier(1 << 20, (2, 2, 1, 4), torch.float32)], identity,
    ...                          async_writes=False)
    >>> key = ChunkKey(None, (11, 12, 13))  # the default namespace's chunk of three tokens
    >>> record = ChunkRecord(torch.randn(3, 2, 2, 1, 4))  # [n_tokens, layers, 2, kv_heads, head_dim]
    >>> where = store.spill_wanted(key)
    >>> str(where), store.spill(key, record, where)
    ('host', True)
    >>> loaded, tier = store.get(key)
    >>> torch.equal(loaded.kv, record.kv), str(tier)
    (True, 'host')
    >>> store.close()
    """

    def __init__(self, tiers: Sequence[Tier], identity: ModelIdentity, *, async_writes: bool = True,
                 max_staged_bytes: int = 256 << 20) -> None:
        """``async_writes`` False: write-through on the caller's thread; ``max_staged_bytes``: prefetch's bound."""
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        self.tiers: dict[TierName, Tier] = {t.name: t for t in tiers}
        self.identity = identity
        self.digest = identity.digest
        self.writers = {t.name: AsyncWriter(t) for t in tiers if t.role.write_through and async_writes}
        self.stage = PrefetchStage(max_staged_bytes, self._count_prefetch)
        self.counters = {t.name: _store_counters(t) for t in tiers}

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @property
    def names(self) -> list[TierName]:
        return list(self.tiers)

    def tier(self, name: str) -> Optional[Tier]:
        return self.tiers.get(name)

    @property
    def can_prefetch(self) -> bool:
        return any(t.role.prefetchable for t in self.tiers.values())

    def record_access(self, key: ChunkKey) -> None:
        """One lookup of the chunk by the server (admission's frequencies)."""
        content = key.content_key(self.digest)
        for tier in self.tiers.values():
            tier.record_access(content)

    def where(self, key: ChunkKey) -> Optional[TierName]:
        """The first tier holding the chunk, or None (a hint; ``get`` verifies)."""
        return self._where(key.content_key(self.digest))

    def _where(self, content: str) -> Optional[TierName]:
        for name, tier in self.tiers.items():
            if tier.exists(content):
                return name
        return None


    def get(self, key: ChunkKey) -> tuple[Optional[ChunkRecord], Optional[TierName]]:
        """The chunk's record from the first tier holding it (a staged prefetch first), verified, and its tier."""
        content = key.content_key(self.digest)
        read = self.stage.take(content)
        if read is not None:
            self.counters[read.tier]["prefetch_used"] += 1
            self._count_load(read.tier, read.record, read.seconds)
            return read.record, read.tier
        for name, tier in self.tiers.items():
            t0 = time.perf_counter()
            record = tier.get(content)
            if record is not None:
                self._count_load(name, record, time.perf_counter() - t0)
                return record, name
        return None, None

    def _count_load(self, name: TierName, record: ChunkRecord, seconds: float) -> None:
        c = self.counters[name]
        c["loads"] += 1
        c["loaded_tokens"] += record.n_tokens
        c["loaded_bytes"] += record.nbytes
        c["load_seconds"] += seconds

    def taken(self, key: ChunkKey, name: str) -> None:
        """A chunk loaded from ``name`` is now in the pool: an exclusive tier gives up its copy."""
        tier = self.tiers.get(name)
        if tier is not None and tier.role.exclusive:
            tier.delete(key.content_key(self.digest))

    def prefetch(self, keys: Iterable[ChunkKey]) -> int:
        """Start reading, for a later :meth:`get`, the chunks first held by a prefetchable tier; how many."""
        if not self.can_prefetch:
            return 0
        queued = 0
        for key in keys:
            content = key.content_key(self.digest)
            if not self.stage.wants(content):
                continue
            name = self._where(content)
            if name is None or not self.tiers[name].role.prefetchable:
                continue
            self.stage.queue(content, self.tiers[name])
            queued += 1
        return queued

    def _count_prefetch(self, name: str, event: str) -> None:
        self.counters[name][event] += 1

    def clear_staged(self) -> None:
        self.stage.clear()


    def spill_wanted(self, key: ChunkKey) -> Optional[TierName]:
        """Where a chunk evicted from the device would go (module doc), or None."""
        content, n_tokens = key.content_key(self.digest), len(key.tokens)
        for name, tier in self.tiers.items():
            if tier.role.exclusive:
                if tier.would_admit(content, n_tokens):
                    return name
                self.counters[name]["spill_rejected"] += 1
                tier.count_refused()
            elif tier.role.write_through and not self._holds(name, content):
                return name
        return None

    def spill(self, key: ChunkKey, record: ChunkRecord, name: str) -> bool:
        """Store a chunk evicted from the device in tier ``name`` (from :meth:`spill_wanted`)."""
        content, tier, c = key.content_key(self.digest), self.tiers[name], self.counters[name]
        if tier.role.exclusive:
            ok = tier.set(content, record)
            if ok:
                c["spills"] += 1
                c["spilled_bytes"] += record.nbytes
            return ok
        c["spills"] += 1
        return self._write(name, content, record)

    def publish_wanted(self, key: ChunkKey) -> bool:
        """Whether a newly computed chunk should be written through (some write-through tier lacks it)."""
        content = key.content_key(self.digest)
        return any(t.role.write_through and not self._holds(n, content) for n, t in self.tiers.items())

    def publish(self, key: ChunkKey, record: ChunkRecord) -> bool:
        """Write a newly computed chunk to every write-through tier; True if every write was taken."""
        content, ok = key.content_key(self.digest), True
        for name, tier in self.tiers.items():
            if tier.role.write_through:
                self.counters[name]["publishes"] += 1
                ok = self._write(name, content, record) and ok
        return ok

    def _holds(self, name: TierName, content: str) -> bool:
        """Held, or queued by the tier's writer."""
        writer = self.writers.get(name)
        return (writer is not None and writer.is_pending(content)) or self.tiers[name].exists(content)

    def _write(self, name: TierName, content: str, record: ChunkRecord) -> bool:
        writer = self.writers.get(name)
        if writer is None:
            return self.tiers[name].set(content, record)
        ok = writer.submit(content, record)
        if not ok:
            self.counters[name]["publish_dropped"] += 1
        return ok


    def clear_exclusive(self) -> None:
        """Empty the exclusive tiers (a cache flush; the write-through tiers are what a restart serves)."""
        for tier in self.tiers.values():
            if tier.role.exclusive:
                tier.clear()

    def pending_writes(self) -> int:
        return sum(w.pending() for w in self.writers.values())

    def stats(self) -> dict:
        """Flat counters ``tier_<name>_<counter>`` (module doc) and the identity."""
        out: dict = {"tier_identity": self.digest}
        for name, tier in self.tiers.items():
            row = {**tier.stats(), **self.counters[name]}
            if tier.role.write_through:
                writer = self.writers.get(name)
                row["pending_writes"] = writer.pending() if writer is not None else 0
            if tier.role.prefetchable:
                row["staged_bytes"] = self.stage.bytes_from(name)
            row.update(tier.describe())
            out.update((f"tier_{name}_{k}", v) for k, v in row.items())
        return out

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.stage.close()
