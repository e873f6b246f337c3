"""The KV pool's index of cached chunks: which pool slots hold which chunk's KV.

A cached chunk's KV lives in KV-pool slots (one int slot per token, shared by all layers). The
index maps a :class:`~relaxkv_sglang.cache.chunk_key.ChunkKey` to an entry holding those slots,
counts the requests using it (locks) and evicts unlocked entries least recently used first. It
never touches KV tensors; slots leave only through the ``free_slots`` callback, exactly once each.

Not thread-safe (SGLang's scheduler thread drives it). Per request: ``peek``/``lookup`` -> ``lock``
(or compute + ``insert`` + ``lock``) ... ``unlock``; lock right away, since an unlocked entry may
go at the next ``evict``. Recency is read off the clock given at construction (the server passes
``time.monotonic``, the clock of SGLang's radix nodes), so an owner can evict across both in one
LRU order.

Target size (``target_tokens``, ARC's ghost-list signal): with ``ghost_capacity > 0`` the index
remembers the keys of recently evicted entries (up to that many tokens). A miss on one of them
raises the target by its tokens; a key forgotten without such a miss lowers it; the target stays
in ``[0, ghost_capacity]``.

Standard library and torch only.
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
    """One cached chunk.

    Attributes:
        key: the chunk's namespace and token ids; entries never match across namespaces.
        slots: int64 ``[n_tokens]`` KV-pool slot indices, slot ``i`` holding
            token ``i``'s canonical K/V in every layer.
        canonical_start: position the chunk's K was rotated at (normally 0);
            reuse at position ``p`` needs a rotation by ``p - canonical_start``.
        lock_ref: number of holders currently using the entry; > 0 means it
            cannot be evicted.
        last_access: index clock value of the last lookup hit / insert / unlock
            (non-decreasing across entries; see ``PoolChunkIndex(clock=...)``).
        hits: number of lookups that returned this entry.
        origin: where the entry's KV came from when it was not computed here: a lower
            tier's name (:class:`~relaxkv_sglang.cache.tiers.TierName`) until its first
            hit reports it (the owner clears it); None otherwise.
    """

    key: ChunkKey
    slots: torch.Tensor
    canonical_start: int = 0
    lock_ref: int = 0
    last_access: float = 0
    hits: int = 0
    origin: TierName | None = None

    @property
    def num_tokens(self) -> int:
        """Number of tokens (and slots) in the chunk."""
        return len(self.key.tokens)


@dataclass(frozen=True)
class PoolChunkIndexStats:
    """Snapshot of an index's counters.

    Cumulative since construction (``reset`` does not clear them): ``lookups``,
    ``hits``, ``misses`` (``hits + misses == lookups``), ``hit_tokens`` /
    ``miss_tokens`` (tokens of the looked-up chunks), ``inserts`` (new entries),
    ``duplicate_inserts`` (inserts of an existing key, whose slots were freed),
    ``evictions`` (entries evicted by ``evict``) and ``evicted_tokens``,
    ``ghost_hits`` / ``ghost_hit_tokens`` (misses on recently evicted keys),
    ``ghost_expired_tokens`` (evicted keys forgotten without such a miss).
    Current state: ``entries``, ``tokens_held``, ``locked_tokens``,
    ``locked_entries`` (entries with ``lock_ref > 0``; 0 on an idle server),
    ``target_tokens`` (the learned size, see the module doc).
    """

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
        """Fraction of lookups that hit (0.0 with no lookups)."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Fraction of looked-up chunk tokens that hit (0.0 with no lookups)."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0


class PoolChunkIndex:
    """Map a chunk's key to the pool slots holding its KV, with locks and LRU eviction.

    Every operation is O(1) apart from hashing the token tuple (O(chunk
    length)) and the per-entry work of ``evict``/``reset``: unlocked entries
    sit in an ``OrderedDict`` in LRU order, locked ones are taken out of it.
    """

    def __init__(self, free_slots: Callable[[torch.Tensor], None],
                 clock: Callable[[], float] | None = None, ghost_capacity: int = 0,
                 on_evict: Callable[[ChunkEntry], None] | None = None) -> None:
        """Create an empty index.

        Args:
            free_slots: called with an entry's int64 ``[n_tokens]`` slots when
                they leave the index (eviction, reset, duplicate insert); it
                must return them to the KV allocator.
            clock: the time source of ``last_access`` (e.g. ``time.monotonic``);
                readings are made non-decreasing.  None: a counter (1, 2, ...).
            ghost_capacity: tokens of evicted keys remembered, and the most
                ``target_tokens`` can reach; 0 (default) learns no target.
            on_evict: called with each entry ``evict`` takes, before its slots are freed
                (while they still hold its KV), e.g. to spill it to a lower tier; not
                called by ``reset`` or a duplicate insert.  Exceptions propagate.
        """
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
        """Number of entries."""
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
        """Add a chunk whose canonical KV the caller has written into ``slots``.

        The index takes ownership of ``slots``.  If the key already exists
        (e.g. two requests computed the same chunk concurrently), the NEW slots
        are freed at once through the callback and the existing entry is
        returned (and marked recently used); compare the returned entry's
        ``slots`` with yours to tell.  The returned entry is unlocked: lock it
        before anything can call ``evict``.

        Args:
            key: the chunk, non-empty.
            slots: int64 ``[len(key.tokens)]`` KV-pool slot indices.
            canonical_start: position the chunk's K was rotated at (>= 0).

        Returns:
            The entry now stored under the key.

        Raises:
            ValueError / TypeError: empty chunk, wrong slots dtype/shape, bad canonical_start.
        """
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
        """Take one reference on ``entry``; a locked entry is never evicted.

        Raises:
            ValueError: the entry is no longer in the index.
        """
        self._check_member(entry)
        if entry.lock_ref == 0:
            del self._lru[entry.key]
            self._locked_tokens += entry.num_tokens
        entry.lock_ref += 1

    def unlock(self, entry: ChunkEntry) -> None:
        """Drop one reference; at zero the entry becomes evictable as the most recently used.

        Raises:
            ValueError: ``lock_ref`` is already 0, or the entry is not in the index.
        """
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
        """Evict least-recently-used unlocked entries until ``num_tokens`` slots are freed.

        Stops early when nothing evictable is left.  Whole entries are evicted,
        so more than ``num_tokens`` may be freed.

        Args:
            num_tokens: slots wanted back; <= 0 evicts nothing.

        Returns:
            Number of slots freed (through the callback).
        """
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
        """Slots held by unlocked entries."""
        return self._total_tokens - self._locked_tokens

    def locked_tokens(self) -> int:
        """Slots held by locked entries."""
        return self._locked_tokens

    def total_tokens(self) -> int:
        """Slots held by all entries."""
        return self._total_tokens

    def reset(self) -> None:
        """Free every entry's slots and empty the index (e.g. on a cache flush).

        Requires that no entry is locked: a locked entry's slots are in use by a
        running request, and freeing them would let the allocator hand them out
        twice.  Counters in ``stats()`` are cumulative and kept.

        Raises:
            RuntimeError: some entry is locked; the index is left unchanged.
        """
        if self._locked_tokens or len(self._lru) != len(self._entries):
            locked = len(self._entries) - len(self._lru)
            raise RuntimeError(f"cannot reset the pool's chunk index: {locked} entries are locked")
        for entry in list(self._entries.values()):
            self._drop(entry)
        self._ghosts.clear()
        self._ghost_tokens = 0
        self._target = 0

    def stats(self) -> PoolChunkIndexStats:
        """Snapshot of the counters (see :class:`PoolChunkIndexStats`)."""
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
