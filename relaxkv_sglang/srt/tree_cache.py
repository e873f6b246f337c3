"""The ``relaxkv`` tree cache: SGLang's radix tree plus a position-independent chunk tree.

Selected with ``--radix-cache-backend relaxkv``. The radix tree (SGLang's own
legacy ``RadixCache``, subclassed) still serves exact prefixes: system prompts,
multi-turn history, any request without chunks. Beside it a
:class:`~relaxkv_sglang.core.chunk_store.ChunkStore` holds each document
chunk's KV once, keyed by its token ids and tenant namespace, reused at any
position by :mod:`relaxkv_sglang.srt.forward`.

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
  Eviction takes radix leaves first (LRU), then unlocked chunks (LRU).

SGLang file touched: ``sglang/srt/mem_cache/radix_cache.py`` (subclassed),
registered through ``mem_cache/registry.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from relaxkv_sglang.core.chunk_store import ChunkStore
from relaxkv_sglang.srt.plan import BACKEND_NAME, request_plan

logger = logging.getLogger(__name__)

_ACTIVE_CACHE = None


def active_cache():
    """The relaxkv tree cache of this scheduler process, or None if not selected."""
    return _ACTIVE_CACHE


def build_cache_class():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
    from sglang.srt.mem_cache.radix_cache import RadixCache

    class RelaxKVTreeCache(RadixCache):
        def __init__(self, params, copier, metrics=None):
            self.chunks: Optional[ChunkStore] = None
            super().__init__(params)  # calls reset()
            self.chunks = ChunkStore(free_slots=self.token_to_kv_pool_allocator.free)
            self.copier = copier
            self.metrics = metrics

        def reset(self):
            # Chunks first: ChunkStore.reset refuses (changing nothing) while an
            # entry is locked, and the radix tree must then stay intact too, or
            # its slots would belong to nobody.
            if self.chunks is not None:
                self.chunks.reset()
            super().reset()

        def match_prefix(self, params):
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

        def checkpoint(self, req, *, up_to: int):
            plan = request_plan(req)
            if plan is not None and plan.reuses_chunks:
                up_to = min(up_to, max(plan.exact_len, req.kv.cache_protected_len))
            return super().checkpoint(req, up_to=up_to)

        def evictable_size(self):
            return super().evictable_size() + (self.chunks.evictable_tokens() if self.chunks else 0)

        def evict(self, params):
            result = super().evict(params)
            short = params.num_tokens - result.num_tokens_evicted
            if short > 0 and self.chunks is not None:
                result = EvictResult(num_tokens_evicted=result.num_tokens_evicted + self.chunks.evict(short))
                self.publish_metrics()
            return result

        def total_size(self):
            return super().total_size() + (self.chunks.total_tokens() if self.chunks else 0)

        def publish_metrics(self) -> None:
            if self.metrics is not None:
                self.metrics.publish(self.chunks.stats())

        def stats(self) -> dict:
            """Chunk tree counters and KV pool occupancy, for /get_server_info."""
            chunk = {f"chunk_{name}": value for name, value in dataclasses.asdict(self.chunks.stats()).items()}
            return {
                **chunk,
                "radix_evictable_tokens": RadixCache.evictable_size(self),
                "radix_protected_tokens": self.protected_size(),
                "kv_available_tokens": int(self.token_to_kv_pool_allocator.available_size()),
            }

        def alloc_chunk_slots(self, n: int) -> Optional[torch.Tensor]:
            """n free KV slots for a new chunk, evicting if needed; None if none."""
            allocator = self.token_to_kv_pool_allocator
            if allocator.available_size() < n:
                self.evict(EvictParams(num_tokens=n - allocator.available_size()))
            if allocator.available_size() < n:
                return None
            slots = allocator.alloc(n)
            return None if slots is None else slots.to(torch.int64)

    return RelaxKVTreeCache


class ChunkMetrics:
    """Chunk-tree counters on SGLang's /metrics (``--enable-metrics``).

    Created in the scheduler process, where SGLang's prometheus client runs in
    multiprocess mode, so /metrics in the HTTP process collects them.
    """

    COUNTERS = ("lookups", "hits", "misses", "hit_tokens", "inserts", "evictions", "evicted_tokens")

    def __init__(self):
        from prometheus_client import Counter, Gauge

        self.counters = {
            name: Counter(f"relaxkv:chunk_{name}", f"Chunk tree {name.replace('_', ' ')} since start.")
            for name in self.COUNTERS
        }
        self.tokens_held = Gauge("relaxkv:chunk_tokens_held", "KV tokens held by the chunk tree.",
                                 multiprocess_mode="mostrecent")
        self.last = dict.fromkeys(self.COUNTERS, 0)

    def publish(self, stats) -> None:
        for name, counter in self.counters.items():
            value = getattr(stats, name)
            if value > self.last[name]:
                counter.inc(value - self.last[name])
            self.last[name] = value
        self.tokens_held.set(stats.tokens_held)


def make_tree_cache(ctx):
    """Factory for ``register_radix_cache_backend('relaxkv', ...)``."""
    global _ACTIVE_CACHE
    from relaxkv_sglang.core.rope import UnsupportedRopeError, rope_spec_from_hf_config
    from relaxkv_sglang.srt.forward import KVCopier

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
    hf_config = ctx.model_config.hf_config.to_dict()
    try:
        rope = rope_spec_from_hf_config(hf_config, is_neox_style=_is_neox_style(ctx))
    except UnsupportedRopeError as exc:
        raise SystemExit(f"relaxkv-sglang: {exc}") from exc
    kv_pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    metrics = ChunkMetrics() if server_args.enable_metrics else None
    cache = build_cache_class()(ctx.params, KVCopier(kv_pool, rope), metrics)
    _ACTIVE_CACHE = cache
    from relaxkv_sglang.srt.repair import supports_repair

    model = getattr(getattr(ctx.tp_worker, "model_runner", None), "model", None)
    if model is not None and not supports_repair(model):
        logger.warning("relaxkv: %s does not run through the repair pass; repair policies are served as pic",
                       type(model).__name__)
    logger.info("relaxkv tree cache ready: rope=%s", rope)
    return cache


def around_get_internal_state(original, scheduler, recv_req):
    """Hook on ``Scheduler.get_internal_state``: add ``relaxkv`` to /get_server_info."""
    output = original(scheduler, recv_req)
    cache = active_cache()
    if cache is not None:
        state = dict(cache.stats(), kv_total_tokens=int(scheduler.max_total_num_tokens))
        output.internal_state["relaxkv"] = state
    return output


def _is_neox_style(ctx) -> bool:
    """Llama/Qwen/Mistral in SGLang use the neox rotation; read it off the model if exposed."""
    model = getattr(getattr(ctx.tp_worker, "model_runner", None), "model", None)
    for module in (model.modules() if model is not None else ()):
        if hasattr(module, "is_neox_style") and hasattr(module, "cos_sin_cache"):
            return bool(module.is_neox_style)
    return True
