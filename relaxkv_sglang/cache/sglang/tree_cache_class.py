"""``RelaxKVTreeCache``: SGLang's radix tree plus the pool's chunk index, with one memory account.

The radix tree serves exact prefixes; the :class:`~relaxkv_sglang.cache.pool_index.PoolChunkIndex` holds
each document chunk's KV once. ``match_prefix`` stops a chunk-reusing request before its first chunk
(``full``: nothing), so a policy means the same whatever is cached; the size and eviction overrides
cover both trees, so free + evictable sees every chunk slot.

SGLang files touched: ``mem_cache/radix_cache.py`` (subclassed; ``evict`` reads its ``evictable_leaves``
and ``eviction_strategy`` and evicts a leaf as ``RadixCache.evict`` does: ``free_segment``,
``_delete_leaf``, ``kv_events.record_remove``); ``on_release`` of ``mem_cache/base_prefix_cache.py``
overridden. Imports SGLang: import it lazily (:func:`~relaxkv_sglang.server.sglang.startup.build_cache_class`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.pool_index import ChunkEntry, PoolChunkIndex
from relaxkv_sglang.cache.tiers import TieredChunkStore, TierName
from relaxkv_sglang.cache.sglang.chunk_metrics import ChunkMetrics
from relaxkv_sglang.cache.sglang.chunk_reuse import ChunkReuse
from relaxkv_sglang.cache.sglang.eviction import EvictionOrder
from relaxkv_sglang.cache.sglang.pins import HOLD_QUEUE_DEPTH, AdmissionHold, AdmissionPins
from relaxkv_sglang.request.plan import request_plan
from relaxkv_sglang.cache.sglang.pool_kv import PoolKV
from relaxkv_sglang.cache.sglang.tier_movement import NoTierMovement, TierMovement

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import TreeNode

    from relaxkv_sglang.cache.sglang.kv_identity import KVIdentity

logger = logging.getLogger(__name__)


class RelaxKVTreeCache(RadixCache):
    def __init__(self, params: CacheInitParams, pool_kv: PoolKV, metrics: Optional[ChunkMetrics] = None,
                 tiers: Optional[TieredChunkStore] = None, admission_hold: bool = True,
                 kv_identity: Optional[KVIdentity] = None) -> None:
        """``admission_hold``: ``RELAXKV_ADMISSION_HOLD``; ``kv_identity``: shown on /get_server_info."""
        self.chunks: Optional[PoolChunkIndex] = None  # reset() runs in RadixCache.__init__, before it exists
        self.pool_kv = pool_kv
        self.kv_identity = kv_identity
        self.movement = TierMovement(tiers, pool_kv) if tiers is not None and tiers.enabled else NoTierMovement()
        self.metrics = metrics
        super().__init__(params)
        # time.monotonic: the clock of TreeNode.last_access_time, so one LRU order spans both trees.
        # ghost_capacity: the index learns what it is worth, up to the whole pool (admission hold).
        chunks = PoolChunkIndex(free_slots=self.token_to_kv_pool_allocator.free, clock=time.monotonic,
                                ghost_capacity=int(self.token_to_kv_pool_allocator.size),
                                on_evict=self.movement.spill)
        self.reuse = ChunkReuse(chunks, pool_kv, self.movement)
        self.admission_pins = AdmissionPins(chunks)
        self.hold = AdmissionHold(chunks, enabled=admission_hold)
        self.chunks = chunks

    # -------------------------------------------------- the RelaxKVCache surface (relaxkv_cache.py)

    @property
    def req_to_token(self) -> torch.Tensor:
        """int32 [max_requests, max_context] each request's KV slot per position."""
        return self.req_to_token_pool.req_to_token

    def publish_chunk(self, key: ChunkKey, src: torch.Tensor, position: int) -> bool:
        """:meth:`~.chunk_reuse.ChunkReuse.publish`, slots from :meth:`alloc_chunk_slots`."""
        return self.reuse.publish(key, src, position, self.alloc_chunk_slots)

    def publish_chunks(self, chunks: Sequence[tuple[ChunkKey, int, int]], req_pool_idx: int) -> None:
        """Publish a request's computed miss chunks, (key, start, end) of its ``req_to_token`` row."""
        row = self.req_to_token[req_pool_idx]
        for key, start, end in chunks:
            self.publish_chunk(key, row[start:end].to(torch.int64), start)

    def alloc_chunk_slots(self, n: int, chunks_only: bool = False) -> Optional[torch.Tensor]:
        """n free KV slots (int64 [n]) for a new chunk, evicting if needed; None if none. ``chunks_only``:
        evict only unpinned chunks, never radix leaves (at admission: the matched prefix is not locked yet)."""
        allocator = self.token_to_kv_pool_allocator
        if allocator.available_size() < n:
            if chunks_only:
                if self.chunks.evict(n - allocator.available_size()):
                    self.update_metrics()
            else:
                self.evict(EvictParams(num_tokens=n - allocator.available_size()))
        if allocator.available_size() < n:
            return None
        slots = allocator.alloc(n)
        return None if slots is None else slots.to(torch.int64)

    # -------------------------------------------------- admission (cache/sglang/admission.py, forward/pipeline.py)

    @property
    def pins(self) -> dict[str, list[tuple[int, ChunkEntry]]]:
        """rid -> [(chunk end, entry)] locked for it, admission to fold."""
        return self.admission_pins.by_request

    @property
    def admission_reserve(self) -> int:
        """Tokens admission leaves to the pool's chunk index, during one admission check."""
        return self.hold.reserve

    def pin_request(self, req: Req) -> int:
        """:meth:`~.pins.AdmissionPins.pin`; a chunk only a lower tier holds is loaded first."""
        return self.admission_pins.pin(req, self._load)

    def _load(self, key: ChunkKey) -> Optional[ChunkEntry]:
        """A lower-tier hit into the pool; only chunks are evicted for it."""
        return self.movement.load(self.chunks, key, lambda n: self.alloc_chunk_slots(n, chunks_only=True))

    def begin_admission(self, waiting_queue: list[Req], chunked_req: Optional[Req] = None) -> None:
        """An admission round starts: the hold learns the queue; the reads of its chunks the pool lacks
        start in the background (:meth:`~.tier_movement.TierMovement.prefetch`)."""
        self.hold.begin(waiting_queue, chunked_req)
        self.movement.prefetch(self.chunks, waiting_queue[:HOLD_QUEUE_DEPTH])

    def update_metrics(self) -> None:
        """Push the chunk counters to /metrics (when ``--enable-metrics``)."""
        if self.metrics is not None:
            self.metrics.publish(self.chunks.stats(), self.movement.tier_stats())

    def stats(self) -> dict:
        """Chunk tree counters and KV pool occupancy, for /get_server_info."""
        chunk = {f"chunk_{name}": value for name, value in dataclasses.asdict(self.chunks.stats()).items()}
        return {
            **chunk,
            "chunk_pinned_requests": len(self.pins),
            "chunk_pins_dropped_at_reset": self.admission_pins.dropped_at_reset,
            "admission_hold": self.hold.enabled,
            "chunk_duplicate_computes": self.reuse.duplicate_computes,
            "chunk_duplicate_compute_tokens": self.reuse.duplicate_compute_tokens,
            "radix_evictable_tokens": RadixCache.evictable_size(self),
            "radix_protected_tokens": self.protected_size(),
            "kv_available_tokens": int(self.token_to_kv_pool_allocator.available_size()),
            "tiers": self.tier_names(),
            **self.movement.stats(),
        }

    def tier_names(self) -> list[str]:
        """The tiers this cache serves from, top first (plain strings: they leave the process)."""
        return [str(n) for n in [TierName.DEVICE, *self.movement.names()]]

    # -------------------------------------------------- RadixCache overrides

    def reset(self) -> None:
        """Empty both trees (SGLang's /flush_cache)."""
        # Chunks first: PoolChunkIndex.reset refuses (changing nothing) while an entry is locked,
        # and the radix tree must then stay intact too, or its slots would belong to nobody.
        if self.chunks is not None:
            if self.pins:  # SGLang flushes only when idle, so no request is left to copy them
                logger.warning("relaxkv: reset drops the chunk pins of %d requests", len(self.pins))
                self.admission_pins.drop_all()
            self.chunks.reset()
            self.movement.clear()
        super().reset()

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        """A request's row was freed (finished, aborted, retracted): drop its chunk pins."""
        self.admission_pins.unpin(req)
        super().on_release(req, checkpointed=checkpointed)

    def match_prefix(self, params: "MatchPrefixParams") -> "MatchResult":
        """The radix match, limited by the request's policy (module doc)."""
        req = params.req
        plan = request_plan(req) if req is not None else None
        if plan is not None and plan.policy == "full":
            return self._empty_match_result
        if plan is not None and plan.reuses_chunks:
            params = dataclasses.replace(params, key=params.key[: plan.exact_len])
        return super().match_prefix(params)

    def checkpoint(self, req: Req, *, up_to: int) -> None:
        """Publish at most the request's exact prefix to the radix tree."""
        plan = request_plan(req)
        if plan is not None and plan.reuses_chunks:
            up_to = min(up_to, max(plan.exact_len, req.kv.cache_protected_len))
        return super().checkpoint(req, up_to=up_to)

    def evictable_size(self) -> int:
        """Evictable tokens of both trees (less the chunk index's reserve during an admission check)."""
        chunks = self.chunks.evictable_tokens() - self.hold.reserve if self.chunks is not None else 0
        return super().evictable_size() + chunks

    def evict(self, params: EvictParams) -> EvictResult:
        """Evict at least ``params.num_tokens`` (if held), radix leaves and unlocked chunks in one LRU order."""
        if self.chunks is None:
            return super().evict(params)
        start = time.perf_counter()
        order = EvictionOrder(() if self.disable else self.evictable_leaves,
                              self.eviction_strategy.get_priority, self.chunks)
        radix_freed = chunk_freed = 0
        while radix_freed + chunk_freed < params.num_tokens:
            victim = order.next()
            if victim is None:
                break
            if isinstance(victim, ChunkEntry):
                chunk_freed += self.chunks.evict(1)  # the oldest entry: victim itself
            else:
                radix_freed += self._evict_leaf(victim, order)
        self.update_eviction_metrics(radix_freed, start)
        if chunk_freed:
            self.update_metrics()
        return EvictResult(num_tokens_evicted=radix_freed + chunk_freed)

    def _evict_leaf(self, leaf: TreeNode, order: EvictionOrder) -> int:
        """Evict one radix leaf as ``RadixCache.evict`` does; its parent may become a victim."""
        self.token_to_kv_pool_allocator.free_segment(leaf.value, start_pos=0)
        freed = len(leaf.value)
        self._delete_leaf(leaf)
        if len(leaf.parent.children) == 0 and leaf.parent.lock_ref == 0:
            order.push_leaf(leaf.parent)
        self.kv_events.record_remove(leaf)
        return freed

    def total_size(self) -> int:
        """Tokens held by both trees."""
        return super().total_size() + (self.chunks.total_tokens() if self.chunks else 0)
