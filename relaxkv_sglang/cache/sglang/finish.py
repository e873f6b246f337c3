"""After the forward (the last stage, :mod:`relaxkv_sglang.server.sglang.pipeline`): misses published, reuse counted, reports.

:func:`finish_forward` takes the forward's rows (:class:`~relaxkv_sglang.repair.sglang.query_pass.ForwardSetup`) and what the
repair did (:attr:`~relaxkv_sglang.repair.sglang.repair_stage.RepairStage.outcomes`) and, per request:

* hands its miss chunks to the chunk tree, now that their KV is computed (a request the repair
  ran for published its own before the anchors overwrote them);
* adds its reused chunk tokens to SGLang's own accounting, by the tier they came from:
  ``req.cached_tokens`` and ``cached_tokens_{device,host,storage}``
  (``meta_info.cached_tokens``, ``cached_tokens_details``, ``sglang:cached_tokens_total``), and
  the batch's prefill statistics (the prefill log line, ``sglang:cache_hit_rate``,
  ``sglang:prefill_effective_tokens_total``);
* merges its ``meta_info.relaxkv`` record (:mod:`relaxkv_sglang.request.report`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from relaxkv_sglang.cache.sglang.cache_source import SGLANG_CACHE_SOURCES, by_cache_source
from relaxkv_sglang.request.report import merge_record, request_record

if TYPE_CHECKING:
    from relaxkv_sglang.repair.sglang.query_pass import ForwardSetup
    from relaxkv_sglang.repair.sglang.repair_stage import RepairOutcome
    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache


def finish_forward(cache: "RelaxKVCache", setup: "ForwardSetup", outcomes: Mapping[int, "RepairOutcome"]) -> None:
    """After the forward: publish miss chunks, count reuse, attach reports (module doc).

    Args:
        cache: the worker's chunk cache.
        setup: the forward's rows, per request in batch order.
        outcomes: index in the batch -> what the repair did, for each request it ran for.
    """
    totals = dict.fromkeys(SGLANG_CACHE_SOURCES, 0)
    for i, r in enumerate(setup.requests):
        f = r.fold
        if f.misses and i not in outcomes:
            cache.publish_chunks(f.plan.namespace, f.misses, f.req_pool_idx)
        sources = by_cache_source(f.hit_sources())
        if f.hit_tokens and not getattr(f.req, "retracted_stain", False):
            # SGLang's cached_tokens_details and sglang:cached_tokens_total{cache_source=...} read
            # cached_tokens_{device,host,storage}, which its own accounting has already set from
            # the radix match: chunk hits are added by the tier they were loaded from. Like
            # SGLang's own count, only the first prefill counts (a retracted request's prefill
            # again reuses the same chunks).
            f.req.cached_tokens += f.hit_tokens
            for source, tokens in sources.items():
                setattr(f.req, f"cached_tokens_{source}", getattr(f.req, f"cached_tokens_{source}") + tokens)
        for source, tokens in sources.items():
            totals[source] += tokens
        if f.plan is not None:
            merge_record(f.req, request_record(r, outcomes.get(i)))
    # SGLang's prefill log line, /metrics sglang:cache_hit_rate and
    # sglang:prefill_effective_tokens_total read these after the forward; admission counted
    # reused chunk tokens as new input.
    stats = getattr(setup.source, "prefill_stats", None)
    hits = sum(totals.values())
    if stats is not None and hits:
        stats.log_hit_tokens += hits
        stats.log_device_hit_tokens += totals["device"]
        stats.log_host_hit_tokens += totals["host"]
        stats.log_storage_hit_tokens += totals["storage"]
        stats.log_input_tokens -= hits
    cache.update_metrics()
