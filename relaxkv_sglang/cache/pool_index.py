"""The KV pool's index of cached chunks: which pool slots hold which chunk's KV.

A :class:`~relaxkv_sglang.cache.chunk_key.ChunkKey` maps to the chunk's KV-pool slots (one per token,
shared by all layers), locked by the requests using it; unlocked entries are evicted least recently used
first. Slots leave only through the ``free_slots`` callback, exactly once each; no KV tensor is touched.

Not thread-safe (SGLang's scheduler thread drives it). Per request: ``peek``/``lookup`` -> ``lock``
(or compute + ``insert`` + ``lock``) ... ``unlock``, locking at once (an unlocked entry may go at the next
``evict``). The server's clock, ``time.monotonic``, is that of SGLang's radix nodes: one LRU order spans both.

Target size (``target_tokens``, ARC's ghost-list signal): with ``ghost_capacity > 0`` evicted keys are
remembered (up to that many tokens); a miss on one raises the target by its tokens, one forgotten
without a miss lowers it, within ``[0, ghost_capacity]``. Standard library and torch only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers.names import TierName

__all__ = ["ChunkEntry", "PoolChunkIndexStats", "PoolChunkIndex"]


@dataclass(eq=False)  # identity semantics: entries hold tensors and are mutable
class ChunkEntry:
    """One cached chunk: ``slots`` int64 ``[n_tokens]``, slot ``i`` holding token ``i``'s canonical K/V in
    every layer, K rotated at ``canonical_start`` (reuse at ``p`` rotates by ``p - canonical_start``);
    ``last_access``: the index clock at the last hit, insert or unlock; ``origin``: the lower tier
    (:class:`~relaxkv_sglang.cache.tiers.TierName`) its KV was loaded from, until its first hit reports it."""

    key: ChunkKey
    slots: torch.Tensor
    canonical_start: int = 0
    lock_ref: int = 0
    last_access: float = 0
    hits: int = 0
    origin: TierName | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key.tokens)


@dataclass(frozen=True)
class PoolChunkIndexStats:
    """An index's counters, cumulative (``reset`` keeps them) but for the current ``entries``, ``tokens_held``,
    ``locked_tokens``, ``locked_entries`` (0 on an idle server) and ``target_tokens``. ``duplicate_inserts``:
    of a held key, their slots freed; ``ghost_hits``: misses on recently evicted keys."""

    lookups: int
    hits: int
    misses: int
    hit_tokens: int
    miss_tokens: int
    inserts: int
    duplicate_inserts: int
    evictions: int
    evicted_tokens: int
    entries: int
    tokens_held: int
    locked_tokens: int
    locked_entries: int = 0
    ghost_hits: int = 0
    ghost_hit_tokens: int = 0
    ghost_expired_tokens: int = 0
    target_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def token_hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


class PoolChunkIndex:
    """A chunk's key to the pool slots holding its KV, with locks and LRU eviction; O(1) but for hashing the
    tokens and ``evict``/``reset``'s per-entry work (unlocked entries in an LRU ``OrderedDict``)."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None],
                 clock: Callable[[], float] | None = None, ghost_capacity: int = 0,
                 on_evict: Callable[[ChunkEntry], None] | None = None) -> None:
        """``free_slots`` returns an entry's int64 ``[n_tokens]`` slots to the KV allocator. ``clock``: of
        ``last_access``, made non-decreasing (None: a counter). ``ghost_capacity``: the most ``target_tokens``
        reaches (0: none). ``on_evict``: given each entry ``evict`` takes while its slots hold its KV (a spill)."""
        self._free_slots = free_slots
        self._on_evict = on_evict
        self._clock_fn = clock
        self._entries: dict[ChunkKey, ChunkEntry] = {}
        self._lru: OrderedDict[ChunkKey, ChunkEntry] = OrderedDict()  # unlocked only, LRU first
        self._clock: float = 0
        self._total_tokens = 0
        self._locked_tokens = 0
        self._lookups = self._hits = self._misses = 0
        self._hit_tokens = self._miss_tokens = 0
        self._inserts = self._duplicate_inserts = 0
        self._evictions = self._evicted_tokens = 0
        self._ghost_capacity = max(0, int(ghost_capacity))
        self._ghosts: OrderedDict[ChunkKey, int] = OrderedDict()  # evicted keys, oldest first
        self._ghost_tokens = 0
        self._ghost_hits = self._ghost_hit_tokens = self._ghost_expired_tokens = 0
        self._target = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _tick(self) -> float:
        if self._clock_fn is None:
            self._clock += 1
        else:  # never backwards, so the OrderedDict order is last_access order
            self._clock = max(self._clock, self._clock_fn())
        return self._clock

    def _touch(self, entry: ChunkEntry) -> None:
        entry.last_access = self._tick()
        if entry.lock_ref == 0:
            self._lru.move_to_end(entry.key)

    def peek(self, key: ChunkKey) -> ChunkEntry | None:
        """Return the entry for ``key``, or None, without counting or touching the LRU."""
        return self._entries.get(key)

    def lookup(self, key: ChunkKey) -> ChunkEntry | None:
        """Return the entry for ``key``, or None; counts a hit or a miss and marks the entry recently used."""
        entry = self._entries.get(key)
        self._lookups += 1
        if entry is None:
            self._misses += 1
            self._miss_tokens += len(key.tokens)
            n = self._ghosts.pop(key, None)
            if n is not None:  # a hit this index lost to an eviction: it is worth more memory
                self._ghost_tokens -= n
                self._ghost_hits += 1
                self._ghost_hit_tokens += n
                self._target = min(self._ghost_capacity, self._target + n)
            return None
        self._hits += 1
        self._hit_tokens += entry.num_tokens
        entry.hits += 1
        self._touch(entry)
        return entry

    def insert(self, key: ChunkKey, slots: torch.Tensor, canonical_start: int = 0) -> ChunkEntry:
        """Add a chunk whose canonical KV the caller wrote into ``slots`` (int64 ``[len(key.tokens)]``, the
        index's now); a key already held (computed twice at once) keeps its entry, the NEW slots freed at
        once. The entry returned is unlocked: lock it before anything can call ``evict``."""
        n = len(key.tokens)
        if n == 0:
            raise ValueError("cannot insert an empty chunk")
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64:
            raise TypeError("slots must be an int64 tensor")
        if slots.shape != (n,):
            raise ValueError(f"slots must have shape [{n}], got {tuple(slots.shape)}")
        if isinstance(canonical_start, bool) or not isinstance(canonical_start, int) or canonical_start < 0:
            raise ValueError(f"canonical_start must be an int >= 0, got {canonical_start!r}")
        existing = self._entries.get(key)
        if existing is not None:
            self._free_slots(slots)
            self._duplicate_inserts += 1
            self._touch(existing)
            return existing
        n_ghost = self._ghosts.pop(key, None)
        if n_ghost is not None:
            self._ghost_tokens -= n_ghost
        entry = ChunkEntry(key=key, slots=slots, canonical_start=canonical_start, last_access=self._tick())
        self._entries[key] = entry
        self._lru[key] = entry
        self._total_tokens += n
        self._inserts += 1
        return entry

    def _check_member(self, entry: ChunkEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            raise ValueError("entry is not in this index (evicted, reset or from another index)")

    def lock(self, entry: ChunkEntry) -> None:
        """Take one reference on ``entry`` (ValueError if it left the index); a locked entry is never evicted."""
        self._check_member(entry)
        if entry.lock_ref == 0:
            del self._lru[entry.key]
            self._locked_tokens += entry.num_tokens
        entry.lock_ref += 1

    def unlock(self, entry: ChunkEntry) -> None:
        """Drop one reference (ValueError if none is held); at zero the entry is evictable, most recently used."""
        self._check_member(entry)
        if entry.lock_ref <= 0:
            raise ValueError("unlock of an entry that is not locked (lock_ref would go negative)")
        entry.lock_ref -= 1
        if entry.lock_ref == 0:
            self._locked_tokens -= entry.num_tokens
            entry.last_access = self._tick()
            self._lru[entry.key] = entry

    def _drop(self, entry: ChunkEntry) -> None:
        # Free first: if the callback raises, the entry stays held, not leaked.
        self._free_slots(entry.slots)
        del self._entries[entry.key]
        self._lru.pop(entry.key, None)
        self._total_tokens -= entry.num_tokens

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used unlocked entries, whole, until ``num_tokens`` slots are freed or none is
        left; the slots freed (may exceed ``num_tokens``)."""
        freed = 0
        while freed < num_tokens and self._lru:
            entry = next(iter(self._lru.values()))
            if self._on_evict is not None:
                self._on_evict(entry)
            self._drop(entry)
            freed += entry.num_tokens
            self._evictions += 1
            self._evicted_tokens += entry.num_tokens
            self._remember(entry)
        return freed

    def _remember(self, entry: ChunkEntry) -> None:
        """Keep an evicted key as a ghost; a ghost forgotten unused lowers the target."""
        if not self._ghost_capacity:
            return
        self._ghosts[entry.key] = entry.num_tokens
        self._ghost_tokens += entry.num_tokens
        while self._ghost_tokens > self._ghost_capacity:
            _, n = self._ghosts.popitem(last=False)
            self._ghost_tokens -= n
            self._ghost_expired_tokens += n
            self._target = max(0, self._target - n)

    def target_tokens(self) -> int:
        """Tokens the index has learned it is worth (module doc); 0 without ghosts."""
        return self._target

    def oldest(self) -> ChunkEntry | None:
        """The unlocked entry ``evict`` would take next (least recently used), or None."""
        return next(iter(self._lru.values()), None)

    def evictable_tokens(self) -> int:
        return self._total_tokens - self._locked_tokens

    def locked_tokens(self) -> int:
        return self._locked_tokens

    def total_tokens(self) -> int:
        return self._total_tokens

    def reset(self) -> None:
        """Free every entry's slots and empty the index (a flush); RuntimeError, changing nothing, while an
        entry is locked (its slots are a running request's: the allocator would hand them out twice)."""
        if self._locked_tokens or len(self._lru) != len(self._entries):
            locked = len(self._entries) - len(self._lru)
            raise RuntimeError(f"cannot reset the pool's chunk index: {locked} entries are locked")
        for entry in list(self._entries.values()):
            self._drop(entry)
        self._ghosts.clear()
        self._ghost_tokens = 0
        self._target = 0

    def stats(self) -> PoolChunkIndexStats:
        return PoolChunkIndexStats(
            lookups=self._lookups,
            hits=self._hits,
            misses=self._misses,
            hit_tokens=self._hit_tokens,
            miss_tokens=self._miss_tokens,
            inserts=self._inserts,
            duplicate_inserts=self._duplicate_inserts,
            evictions=self._evictions,
            evicted_tokens=self._evicted_tokens,
            entries=len(self._entries),
            tokens_held=self._total_tokens,
            locked_tokens=self._locked_tokens,
            locked_entries=len(self._entries) - len(self._lru),
            ghost_hits=self._ghost_hits,
            ghost_hit_tokens=self._ghost_hit_tokens,
            ghost_expired_tokens=self._ghost_expired_tokens,
            target_tokens=self._target,
        )
