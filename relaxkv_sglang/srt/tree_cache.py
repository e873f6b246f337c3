"""The ``relaxkv`` tree cache: SGLang's radix tree plus a position-independent chunk tree.

Selected with ``--radix-cache-backend relaxkv``. The radix tree (SGLang's own
legacy ``RadixCache``, subclassed) still serves exact prefixes: system prompts,
multi-turn history, any request without chunks. Beside it a
:class:`~relaxkv_sglang.core.chunk_store.ChunkStore` holds each document
chunk's KV once, keyed by its token ids and tenant namespace.

The cache owns every operation on chunk KV; the fold (:mod:`.fold`) only asks:

* :meth:`reuse_chunk`: look a chunk up and copy it into a request's slots
  with K re-rotated to where it now sits;
* :meth:`publish_chunk`: copy a freshly computed chunk into slots the chunk
  store owns (evicting if needed) and index it.

What this class changes in the radix tree's behaviour:

* ``match_prefix``: a ``full`` request matches nothing (no reuse at all); a
  request that reuses chunks matches at most its prefix before the first chunk.
* ``checkpoint`` (publishing a request's KV when it finishes): a request whose
  chunks were reused or computed position-independently publishes only its
  exact part (the tokens before its first chunk); its chunk KV is not the exact
  causal KV and must never answer an exact prefix match.
* ``evictable_size`` / ``evict`` / ``reset`` cover both trees, so the
  scheduler's memory accounting (free + evictable) sees every chunk slot, and
  an idle server with a flushed cache has every slot back in the free list.
  Eviction is one LRU order over radix leaves and unlocked chunks: the chunk
  store runs on ``time.monotonic``, the clock of ``TreeNode.last_access_time``,
  and each victim is the older of the radix tree's next leaf and the chunk
  store's oldest entry.
* ``on_release`` (a request's row freed): drops its chunk pins, if any.

Lower tiers (:mod:`.tiers`, :mod:`relaxkv_sglang.core.tiers`; off unless
``RELAXKV_HOST_CACHE_GB`` or ``RELAXKV_CHUNK_DIR`` is set). A chunk the LRU evicts
from the pool spills to the host tier (if its admission takes it), else to disk if the
disk lacks it (``ChunkStore(on_evict=...)``, before its slots are freed); a chunk
computed here is written to disk in the background (:meth:`publish_chunk`). At admission
:meth:`pin_request` loads a chunk the pool lacks but a lower tier holds (host first,
checksum-verified from disk) into slots the chunk store owns and pins it like any hit
(``ChunkEntry.origin`` names the tier until the fold reports the hit). The disk reads of
queued requests' chunks start in the background when they are first seen in the waiting
queue (:meth:`begin_admission`), so by their admission the read is often done. The fold's own
lookup (:meth:`reuse_chunk`) falls back to the tiers too, copying straight into the
request's slots. Keys are content addresses over the model identity, the namespace and
the tokens, so tenants stay apart in every tier. A flush empties the pool and the host
tier; the disk folder is kept (it is what a restart serves from).

Pins (admission to fold). :mod:`.admission` calls :meth:`pin_request` when the
scheduler's ``PrefillAdder`` considers a request: every chunk of its window the
store holds is locked, so the adder's budget (free + ``evictable_size``) no
longer counts it and nothing (other admissions, ``alloc_for_extend``, another
request's publish) can evict it before the fold copies it. The forward hook
calls :meth:`unpin_requests` once the batch ran; a request not admitted, a
released request (``on_release``) and ``reset`` drop theirs too.
``stats()["chunk_locked_entries"]`` is 0 whenever no admitted request waits
for its forward. While other requests run, admission also holds (for the
length of one ``add_one_req`` call) the chunks that queued requests need and
the chunk store's learned share of the pool (:meth:`admission_hold`,
``ChunkStore.target_tokens``), so a new request is admitted only if it fits
without evicting them (docs/reliability.md, "Chunk hits under memory pressure").

The scheduler's worker finds its cache through :func:`worker_cache` (the
factory attaches it to ``TreeCacheBuildContext.tp_worker``), so no module
holds a process-wide reference. The factory also runs the startup correctness gate
(:mod:`.gate`) once on the loaded model; ``/get_server_info`` shows its verdict
(``relaxkv.gate``).

SGLang files touched: ``sglang/srt/mem_cache/radix_cache.py`` (subclassed; ``evict``
reads its ``evictable_leaves`` and ``eviction_strategy``; ``on_release`` of
``mem_cache/base_prefix_cache.py`` overridden),
registered through ``mem_cache/registry.py``; ``managers/scheduler.py``
``Scheduler.get_internal_state`` (around, for /get_server_info).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch

from relaxkv_sglang.core.chunk_store import ChunkEntry, ChunkStore, ChunkStoreStats
from relaxkv_sglang.core.tiers import LOWER_TIERS, TieredChunkStore, TierName
from relaxkv_sglang.core.rope import RopeSpec, UnsupportedRopeError, rope_spec_from_hf_config, rotate_keys
from relaxkv_sglang.srt.gate import gate_state, run_startup_gate, serving_rope
from relaxkv_sglang.srt.layer_loop import supports_repair
from relaxkv_sglang.srt.plan import BACKEND_NAME, request_plan
from relaxkv_sglang.srt.tiers import PoolKV, build_tiers, model_identity, tier_config_from_env

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.memory_pool import KVCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)

# Attribute of SGLang's TpModelWorker that holds its relaxkv tree cache.
_WORKER_ATTR = "relaxkv_cache"

# RELAXKV_ADMISSION_HOLD=0 turns off the admission hold on chunks queued
# requests need (pins of admitted requests stay): more concurrency, fewer hits.
HOLD_ENV = "RELAXKV_ADMISSION_HOLD"
# Queued requests (in queue order) whose chunks the admission hold protects.
HOLD_QUEUE_DEPTH = 256


def chunk_keys(req: Any, plan: Any) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, end, token ids) of each chunk of the request, computed once per request."""
    keys = req.__dict__.get("_relaxkv_chunk_keys")
    if keys is None:
        ids = req.origin_input_ids
        keys = [(cs, ce, tuple(ids[cs:ce])) for cs, ce in plan.chunk_spans]
        req.__dict__["_relaxkv_chunk_keys"] = keys
    return keys


class ChunkCache(Protocol):
    """The surface of the tree cache the fold and the repair use."""

    @property
    def req_to_token(self) -> torch.Tensor:
        """int32 [max_requests, max_context] each request's KV slot per position."""

    @property
    def kv_pool(self) -> "KVCache":
        """SGLang's KV pool (per-layer K and V buffers)."""

    def reuse_chunk(self, namespace: Optional[str], tokens: Sequence[int], dst: torch.Tensor,
                    position: int) -> Optional[TierName]:
        """Copy a cached chunk into ``dst`` re-rotated to ``position``; the tier it came from
        (a :class:`~relaxkv_sglang.core.tiers.TierName`), None on a miss."""

    def publish_chunk(self, namespace: Optional[str], tokens: Sequence[int], src: torch.Tensor, position: int) -> bool:
        """Store a chunk computed at ``position`` in slots ``src``; False if not stored."""

    def update_metrics(self) -> None:
        """Push the chunk counters to /metrics."""


def worker_cache(worker: Any) -> Optional["ChunkCache"]:
    """The relaxkv tree cache of this scheduler's worker, or None if not selected."""
    return getattr(worker, _WORKER_ATTR, None)


class KVCopier:
    """Copies K/V rows between pool slots for every layer, re-rotating K."""

    def __init__(self, kv_pool: "KVCache", rope: RopeSpec) -> None:
        self.kv_pool = kv_pool
        self.rope = rope
        self.layers = range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """src, dst: int64 [n] slots; K is rotated by ``delta`` positions, V copied."""
        for layer in self.layers:
            k_buf = self.kv_pool.get_key_buffer(layer)
            v_buf = self.kv_pool.get_value_buffer(layer)
            k = k_buf[src]
            k_buf[dst] = rotate_keys(k, delta, self.rope) if delta else k
            v_buf[dst] = v_buf[src]


def build_cache_class() -> type:
    """The cache class, built lazily so this module imports without sglang."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
    from sglang.srt.mem_cache.radix_cache import RadixCache

    class RelaxKVTreeCache(RadixCache):
        """SGLang's radix tree plus the chunk store, with one memory account (module doc)."""

        def __init__(self, params: Any, copier: KVCopier, metrics: Optional["ChunkMetrics"] = None,
                     tiers: Optional[TieredChunkStore] = None, pool_kv: Optional[PoolKV] = None) -> None:
            self.chunks: Optional[ChunkStore] = None
            self.tiers = tiers if tiers is not None and tiers.enabled else None
            self.pool_kv = pool_kv
            self.pins: dict[str, list] = {}  # rid -> [(chunk end, entry)] locked for it, admission to fold
            super().__init__(params)  # calls reset()
            # time.monotonic: the clock of TreeNode.last_access_time, so one LRU order spans both trees.
            # ghost_capacity: the store learns what it is worth, up to the whole pool (admission_hold).
            self.chunks = ChunkStore(free_slots=self.token_to_kv_pool_allocator.free, clock=time.monotonic,
                                     ghost_capacity=int(self.token_to_kv_pool_allocator.size),
                                     on_evict=self._spill if self.tiers is not None else None)
            self.tier_load_no_room = 0  # lower-tier hits not loaded at admission: no free slots
            self.tier_errors = 0  # spills / loads that raised (logged; the chunk is then a miss)
            self.copier = copier
            self.metrics = metrics
            self.hold_enabled = os.environ.get(HOLD_ENV, "1") != "0"
            self.queue: Optional[list] = None  # the waiting queue, during an admission round
            self.hot: Optional[list] = None  # entries queued requests need, computed once per round
            self.admission_reserve = 0  # tokens admission leaves to the chunk store, during one admission check
            self.pins_dropped_at_reset = 0  # requests whose pins a flush found (a leak: flushes happen when idle)
            self.duplicate_computes = 0  # miss chunks computed while another copy was already stored
            self.duplicate_compute_tokens = 0

        # -------------------------------------------------- chunk operations (ChunkCache)

        @property
        def req_to_token(self) -> torch.Tensor:
            """int32 [max_requests, max_context] each request's KV slot per position."""
            return self.req_to_token_pool.req_to_token

        @property
        def kv_pool(self) -> "KVCache":
            """SGLang's KV pool (per-layer K and V buffers)."""
            return self.copier.kv_pool

        def reuse_chunk(self, namespace: Optional[str], tokens: Sequence[int], dst: torch.Tensor,
                        position: int) -> Optional[str]:
            """Copy a cached chunk into a request's slots, K re-rotated to ``position``.

            Args:
                namespace: the tenant namespace (see ``plan.request_namespace``).
                tokens: the chunk's token ids (counted as a lookup).
                dst: int64 [len(tokens)] the request's slots for the chunk.
                position: where the chunk's first token sits in the request.
            Returns:
                On a hit (``dst`` now holds the chunk's KV) the tier it was served from:
                ``TierName.DEVICE``, or the lower tier a chunk was loaded from (at
                admission, or here when the pool lacks it); None on a miss.
            """
            key = None
            if self.tiers is not None:
                key = self.tiers.key(namespace, tokens)
                self.tiers.record_access(key)  # the admission sketch sees every lookup
            entry = self.chunks.lookup(namespace, tokens)
            if entry is None:
                return self._reuse_from_tiers(key, dst, position) if key is not None else None
            self.chunks.lock(entry)  # nothing may evict it while it is read
            try:
                self.copier.copy(entry.slots, dst, position - entry.canonical_start)
            finally:
                self.chunks.unlock(entry)
            origin, entry.origin = entry.origin, None
            return origin or TierName.DEVICE

        def _reuse_from_tiers(self, key: str, dst: torch.Tensor, position: int) -> Optional[str]:
            """A pool miss served from a lower tier, copied straight into the request's slots."""
            try:
                record, tier = self.tiers.get(key)
                if record is None:
                    return None
                self.pool_kv.write(dst, record, position - record.canonical_start)
            except Exception:  # noqa: BLE001 - a lower tier never fails a request: it is a miss
                logger.exception("relaxkv: loading a chunk from a lower tier failed; computing it")
                self.tier_errors += 1
                return None
            return tier

        def publish_chunk(self, namespace: Optional[str], tokens: Sequence[int], src: torch.Tensor,
                          position: int) -> bool:
            """Copy a chunk computed position-independently into slots the chunk store owns.

            Args:
                namespace: the tenant namespace.
                tokens: the chunk's token ids.
                src: int64 [len(tokens)] the request's slots holding its KV.
                position: where it was computed (its canonical start).
            Returns:
                True if stored now; False if already held (another request of the batch
                published it) or no room even after eviction (a cache may skip an insert).
            """
            if self.chunks.peek(namespace, tokens) is not None:
                # computed twice: another request of the batch (or one that missed it
                # at its fold) published it first; see docs/reliability.md
                self.duplicate_computes += 1
                self.duplicate_compute_tokens += len(tokens)
                return False
            slots = self.alloc_chunk_slots(len(tokens))
            if slots is not None:
                self.copier.copy(src, slots, 0)
                self.chunks.insert(namespace, tokens, slots, canonical_start=position)
            if self.tiers is not None:  # written through to disk (in the background), for restarts
                key = self.tiers.key(namespace, tokens)
                if self.tiers.publish_wanted(key):
                    try:  # from the request's own slots: stored on disk even when the pool had no room
                        self.tiers.publish(key, self.pool_kv.read(src, position))
                    except Exception:  # noqa: BLE001
                        logger.exception("relaxkv: writing a chunk to disk failed")
                        self.tier_errors += 1
            return slots is not None

        # -------------------------------------------------- lower tiers: spill and load

        def _spill(self, entry: ChunkEntry) -> None:
            """``ChunkStore`` evicts ``entry``: keep its KV in a lower tier (while its slots hold it)."""
            try:
                key = self.tiers.key(entry.namespace, entry.token_ids)
                tier = self.tiers.spill_wanted(key, entry.num_tokens)
                if tier is not None:
                    self.tiers.spill(key, self.pool_kv.read(entry.slots, entry.canonical_start), tier)
            except Exception:  # noqa: BLE001 - eviction must go on; the chunk is just gone
                logger.exception("relaxkv: spilling an evicted chunk failed")
                self.tier_errors += 1

        def _load(self, namespace: Optional[str], tokens: Sequence[int]) -> Optional[ChunkEntry]:
            """A chunk the pool lacks, loaded from a lower tier into store-owned slots (unlocked)."""
            key = self.tiers.key(namespace, tokens)
            if self.tiers.where(key) is None:
                return None
            try:
                record, tier = self.tiers.get(key)
                if record is None:  # damaged on disk: removed and counted by the tier
                    return None
                # only chunks are evicted for it: the request's radix prefix is not locked yet
                slots = self.alloc_chunk_slots(len(tokens), chunks_only=True)
                if slots is None:
                    self.tier_load_no_room += 1
                    return None
                self.pool_kv.write(slots, record)
            except Exception:  # noqa: BLE001
                logger.exception("relaxkv: loading a chunk from a lower tier failed; computing it")
                self.tier_errors += 1
                return None
            entry = self.chunks.insert(namespace, tokens, slots, canonical_start=record.canonical_start)
            entry.origin = tier
            self.tiers.taken(key, tier)  # an exclusive tier gives its copy up
            return entry

        # -------------------------------------------------- pins: admission to fold

        def pin_request(self, req: Any) -> int:
            """Lock every chunk of ``req`` after its matched prefix that the store holds.

            Called at admission (before the adder checks its budget), so the pinned
            tokens leave ``evictable_size`` at once. Idempotent per request: earlier
            pins of the same request are dropped first. Returns the pool tokens pinned: a
            chunk the request holds twice is locked twice but counted once.
            """
            self.unpin_request(req)
            plan = request_plan(req)
            if plan is None or not plan.reuses_chunks:
                return 0
            start = req.prefix_len
            pins = []
            for cs, ce, tokens in chunk_keys(req, plan):
                if ce < start:  # settled by an earlier window (fold.settles_in_window)
                    continue
                entry = self.chunks.peek(plan.namespace, tokens)
                if entry is None and self.tiers is not None:
                    entry = self._load(plan.namespace, tokens)  # a lower-tier hit, into the pool
                if entry is not None:
                    self.chunks.lock(entry)
                    pins.append((ce, entry))
            if pins:
                self.pins[req.rid] = pins
            return sum(e.num_tokens for e in {id(e): e for _, e in pins}.values())

        def trim_pins(self, req: Any, end: int) -> None:
            """Keep only the pins of chunks that end by ``end`` (the admitted window's end)."""
            pins = self.pins.get(req.rid)
            if not pins:
                return
            keep = []
            for ce, entry in pins:
                if ce > end:
                    self.chunks.unlock(entry)
                else:
                    keep.append((ce, entry))
            if keep:
                self.pins[req.rid] = keep
            else:
                del self.pins[req.rid]

        def unpin_request(self, req: Any) -> None:
            """Drop the request's pins (copied, not admitted, finished, aborted)."""
            for _, entry in self.pins.pop(req.rid, ()):
                self.chunks.unlock(entry)

        def unpin_requests(self, reqs: Iterable[Any]) -> None:
            """Drop the pins of a batch's requests (after its forward)."""
            if self.pins:
                for req in reqs:
                    self.unpin_request(req)

        def begin_admission(self, waiting_queue: list, chunked_req: Any = None) -> None:
            """An admission round starts: queued requests' chunks may be held (see admission_hold);
            with a disk tier, the disk reads of their chunks the pool lacks start in the background."""
            self.queue = ([chunked_req] if chunked_req is not None else []) + list(waiting_queue)
            self.hot = None
            if self.tiers is not None and self.tiers.can_prefetch:
                self._prefetch(waiting_queue)

        def _prefetch(self, waiting_queue: list) -> None:
            """Queue the disk reads of each newly queued request's chunks the pool lacks (once per request)."""
            keys = []
            for req in waiting_queue[:HOLD_QUEUE_DEPTH]:
                if req.__dict__.get("_relaxkv_prefetched"):
                    continue
                req.__dict__["_relaxkv_prefetched"] = True
                plan = request_plan(req)
                if plan is None or not plan.reuses_chunks:
                    continue
                for _cs, _ce, tokens in chunk_keys(req, plan):
                    if self.chunks.peek(plan.namespace, tokens) is None:
                        keys.append(self.tiers.key(plan.namespace, tokens))
            if keys:
                self.tiers.prefetch(keys)

        def end_admission(self) -> None:
            """The admission round is over."""
            self.queue = self.hot = None

        def _hot_entries(self) -> list:
            """Stored chunks the first HOLD_QUEUE_DEPTH queued requests need, each once."""
            if self.hot is None:
                seen: dict[int, Any] = {}
                for req in (self.queue or ())[:HOLD_QUEUE_DEPTH]:
                    plan = request_plan(req)
                    if plan is None or not plan.reuses_chunks:
                        continue
                    for _cs, _ce, tokens in chunk_keys(req, plan):
                        entry = self.chunks.peek(plan.namespace, tokens)
                        if entry is not None:
                            seen.setdefault(id(entry), entry)
                self.hot = list(seen.values())
            return self.hot

        @contextlib.contextmanager
        def admission_hold(self) -> Iterator[int]:
            """For the duration of one admission check (while other requests run), keep the
            chunk store's share of the pool out of the adder's budget.

            * the chunks queued requests need are locked, so they count as not evictable;
              on exit they are unlocked as the most recently used (other chunks go first);
            * ``reserve`` = the store's learned size (``ChunkStore.target_tokens``) minus
              what is locked in it is taken off ``evictable_size``: a request is admitted
              only if it fits while the store keeps (or may grow back to) that size.

            Yields the tokens held back (locked + reserved).
            """
            if not self.hold_enabled:
                yield 0
                return
            held = [e for e in self._hot_entries() if self.chunks.peek(e.namespace, e.token_ids) is e]
            for entry in held:
                self.chunks.lock(entry)
            try:
                self.admission_reserve = max(0, self.chunks.target_tokens() - self.chunks.locked_tokens())
                yield sum(e.num_tokens for e in held) + self.admission_reserve
            finally:
                self.admission_reserve = 0
                for entry in held:
                    self.chunks.unlock(entry)

        def update_metrics(self) -> None:
            """Push the chunk counters to /metrics (when ``--enable-metrics``)."""
            if self.metrics is not None:
                self.metrics.publish(self.chunks.stats(), self.tiers.stats() if self.tiers is not None else None)

        def stats(self) -> dict:
            """Chunk tree counters and KV pool occupancy, for /get_server_info."""
            chunk = {f"chunk_{name}": value for name, value in dataclasses.asdict(self.chunks.stats()).items()}
            return {
                **chunk,
                "chunk_pinned_requests": len(self.pins),
                "chunk_pins_dropped_at_reset": self.pins_dropped_at_reset,
                "admission_hold": self.hold_enabled,
                "chunk_duplicate_computes": self.duplicate_computes,
                "chunk_duplicate_compute_tokens": self.duplicate_compute_tokens,
                "radix_evictable_tokens": RadixCache.evictable_size(self),
                "radix_protected_tokens": self.protected_size(),
                "kv_available_tokens": int(self.token_to_kv_pool_allocator.available_size()),
                "tiers": self.tier_names(),
                **(self.tiers.stats() if self.tiers is not None else {}),
                **({"tier_load_no_room": self.tier_load_no_room, "tier_errors": self.tier_errors}
                   if self.tiers is not None else {}),
            }

        def tier_names(self) -> list[str]:
            """The tiers this cache serves from, top first (plain strings: they leave the process)."""
            return [str(n) for n in [TierName.DEVICE, *(self.tiers.names if self.tiers is not None else [])]]

        def alloc_chunk_slots(self, n: int, chunks_only: bool = False) -> Optional[torch.Tensor]:
            """n free KV slots for a new chunk, evicting if needed; None if none.

            ``chunks_only``: evict only unpinned chunks, never radix leaves (at admission, where
            a request's matched prefix is not locked yet)."""
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

        # -------------------------------------------------- RadixCache overrides

        def reset(self) -> None:
            """Empty both trees (SGLang's /flush_cache)."""
            # Chunks first: ChunkStore.reset refuses (changing nothing) while an
            # entry is locked, and the radix tree must then stay intact too, or
            # its slots would belong to nobody.
            if self.chunks is not None:
                if self.pins:  # SGLang flushes only when idle, so no request is left to copy them
                    logger.warning("relaxkv: reset drops the chunk pins of %d requests", len(self.pins))
                    self.pins_dropped_at_reset += len(self.pins)
                    for rid in list(self.pins):
                        for _, entry in self.pins.pop(rid):
                            self.chunks.unlock(entry)
                self.chunks.reset()
                if self.tiers is not None:
                    self.tiers.clear_exclusive()  # the disk folder stays: it is what a restart serves
                    self.tiers.clear_staged()
            super().reset()

        def on_release(self, req: Any, *, checkpointed: bool) -> None:
            """A request's row was freed (finished, aborted, retracted): drop its chunk pins."""
            self.unpin_request(req)
            super().on_release(req, checkpointed=checkpointed)

        def match_prefix(self, params: "MatchPrefixParams") -> "MatchResult":
            """The radix match, limited by the request's policy (module doc)."""
            req = params.req
            plan = request_plan(req) if req is not None else None
            if plan is not None and plan.policy == "full":
                return self._empty_match_result
            if plan is not None and plan.reuses_chunks:
                # The radix tree serves only the exact prefix before the first
                # chunk; chunks always come from the chunk tree, so a policy
                # means the same thing whatever else is cached.
                params = dataclasses.replace(params, key=params.key[: plan.exact_len])
            return super().match_prefix(params)

        def checkpoint(self, req: Any, *, up_to: int) -> Any:
            """Publish at most the request's exact prefix to the radix tree."""
            plan = request_plan(req)
            if plan is not None and plan.reuses_chunks:
                up_to = min(up_to, max(plan.exact_len, req.kv.cache_protected_len))
            return super().checkpoint(req, up_to=up_to)

        def evictable_size(self) -> int:
            """Evictable tokens of both trees (less the chunk store's reserve during an admission check)."""
            chunks = self.chunks.evictable_tokens() - self.admission_reserve if self.chunks is not None else 0
            return super().evictable_size() + chunks

        def evict(self, params: "EvictParams") -> "EvictResult":
            """One LRU order over radix leaves and unlocked chunks (module doc).

            Each step takes the older of the radix tree's next victim (the leaf its
            eviction strategy ranks first; under the default ``lru`` the least recently
            used) and the chunk store's least recently used entry, by last use.
            """
            if self.chunks is None:
                return super().evict(params)
            freed = chunk_freed = 0
            while freed < params.num_tokens:
                entry = self.chunks.oldest()
                leaf = self._next_radix_victim()
                if entry is None and leaf is None:
                    break
                if entry is None or (leaf is not None and leaf.last_access_time <= entry.last_access):
                    got = super().evict(EvictParams(num_tokens=1)).num_tokens_evicted  # exactly that leaf
                    if got == 0:  # nothing left on the radix side after all
                        if entry is None:
                            break
                        got = self.chunks.evict(1)
                        chunk_freed += got
                else:
                    got = self.chunks.evict(1)
                    chunk_freed += got
                freed += got
            if chunk_freed:
                self.update_metrics()
            return EvictResult(num_tokens_evicted=freed)

        def _next_radix_victim(self) -> Any:
            """The leaf ``RadixCache.evict`` would take first, or None."""
            if self.disable or not self.evictable_leaves:
                return None
            return min(self.evictable_leaves, key=self.eviction_strategy.get_priority)

        def total_size(self) -> int:
            """Tokens held by both trees."""
            return super().total_size() + (self.chunks.total_tokens() if self.chunks else 0)

    return RelaxKVTreeCache


class ChunkMetrics:
    """Chunk-tree counters on SGLang's /metrics (``--enable-metrics``).

    Created in the scheduler process, where SGLang's prometheus client runs in
    multiprocess mode, so /metrics in the HTTP process collects them. Every series carries
    ``labels`` (SGLang's ``model_name``), so dashboards filter them as SGLang's own.
    """

    COUNTERS = ("lookups", "hits", "misses", "hit_tokens", "miss_tokens", "inserts", "evictions", "evicted_tokens")
    GAUGES = {"tokens_held": "KV tokens held by the chunk tree.", "entries": "Chunks held by the chunk tree."}

    def __init__(self, labels: Optional[dict[str, str]] = None) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = dict(labels or {})
        self._counter, self._gauge = Counter, Gauge
        self.counters = {name: self._new_counter(f"relaxkv:chunk_{name}", f"Chunk tree {name.replace('_', ' ')} since start.")
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

    def publish(self, stats: ChunkStoreStats, tier_stats: Optional[dict] = None) -> None:
        """Advance the counters to the store's totals (and the lower tiers', when present)."""
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


# Lower-tier counters on /metrics (relaxkv:tier_<tier>_<name>), and gauges (current occupancy).
TIER_METRICS = {f"tier_{tier}_{name}" for tier in LOWER_TIERS for name in (
    "hits", "misses", "loads", "loaded_tokens", "loaded_bytes", "load_seconds", "spills", "spilled_bytes",
    "rejected", "evictions", "evicted_bytes", "writes", "written_bytes", "write_errors", "corrupt", "foreign",
    "publish_dropped", "spill_rejected")}
TIER_GAUGES = ("_bytes_held", "_entries", "_pending_writes")


def make_tree_cache(ctx: "TreeCacheBuildContext") -> Any:
    """Factory for ``register_radix_cache_backend('relaxkv', ...)``."""
    server_args = ctx.server_args
    if server_args.attention_backend != BACKEND_NAME:
        raise SystemExit(
            "relaxkv-sglang: --radix-cache-backend relaxkv needs --attention-backend relaxkv "
            f"(got {server_args.attention_backend!r})"
        )
    if ctx.params.page_size != 1:
        raise SystemExit(f"relaxkv-sglang: chunk reuse needs --page-size 1 (got {ctx.params.page_size})")
    if ctx.enable_hierarchical_cache or ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise SystemExit("relaxkv-sglang: hierarchical, sliding-window and hybrid caches are not supported")
    model = getattr(getattr(ctx.tp_worker, "model_runner", None), "model", None)
    hf_config = ctx.model_config.hf_config.to_dict()
    try:
        rope = rope_spec_from_hf_config(hf_config, is_neox_style=_is_neox_style(model))
    except UnsupportedRopeError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc}") from exc
    rope = serving_rope(rope)  # the rope unless a test swaps it (gate.ROPE_OVERRIDE_ENV)
    kv_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    metrics = ChunkMetrics({"model_name": served_model_name(server_args)}) if server_args.enable_metrics else None
    tiers = pool_kv = None
    tier_config = tier_config_from_env()  # a malformed RELAXKV_* tier variable stops the server here
    if tier_config.enabled:
        pool_kv = PoolKV(kv_pool, rope)
        # tensor parallelism: each rank holds its own heads' KV, so the rank is part of the layout
        layout = f"{pool_kv.layout()} tp={ctx.tp_rank}/{getattr(server_args, 'tp_size', 1)}"
        identity = model_identity(server_args.model_path, server_args.tokenizer_path, hf_config,
                                  pool_kv.dtype, layout)
        tiers = build_tiers(tier_config, pool_kv, identity)
        logger.info("relaxkv chunk tiers: host %d bytes (%s), disk %s (%d bytes), identity %s",
                    tier_config.host_bytes, tier_config.host_policy, tier_config.disk_dir,
                    tier_config.disk_bytes, identity.digest)
    cache = build_cache_class()(ctx.params, KVCopier(kv_pool, rope), metrics, tiers, pool_kv)
    setattr(ctx.tp_worker, _WORKER_ATTR, cache)
    # The correctness gate on the loaded model (srt/gate.py): a failure refuses chunk policies.
    run_startup_gate(ctx.tp_worker, cache, int(ctx.model_config.context_len), tp_rank=ctx.tp_rank,
                     enable_metrics=bool(server_args.enable_metrics))
    if model is not None and not supports_repair(model):
        logger.warning("relaxkv: %s does not run through the repair pass; repair policies are served as pic",
                       type(model).__name__)
    logger.info("relaxkv tree cache ready: rope=%s", rope)
    return cache


def served_model_name(server_args: Any) -> str:
    """The ``model_name`` label SGLang's own ``sglang:*`` series carry: the served model name,
    which sglang 0.5.23 keeps in its runtime context (not on ``ServerArgs``), else the model path."""
    from sglang.srt.runtime_context import get_serving

    name = getattr(get_serving(), "served_model_name", None) or getattr(server_args, "served_model_name", None)
    return str(name or server_args.model_path)


def around_get_internal_state(original: Any, scheduler: "Scheduler", recv_req: Any) -> Any:
    """Hook on ``Scheduler.get_internal_state``: add ``relaxkv`` to /get_server_info."""
    output = original(scheduler, recv_req)
    cache = worker_cache(scheduler.tp_worker)
    if cache is not None:
        state = dict(cache.stats(), kv_total_tokens=int(scheduler.max_total_num_tokens), gate=gate_state(cache))
        output.internal_state["relaxkv"] = state
    return output


def _is_neox_style(model: Any) -> bool:
    """Llama/Qwen/Mistral in SGLang use the neox rotation; read it off the model if exposed."""
    for module in (model.modules() if model is not None else ()):
        if hasattr(module, "is_neox_style") and hasattr(module, "cos_sin_cache"):
            return bool(module.is_neox_style)
    return True
