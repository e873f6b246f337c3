"""The forward's last stage: misses published (unless the repair stage did), reused chunk tokens added to
SGLang's own accounting by source tier (``req.cached_tokens*``, the batch's prefill statistics), reports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from relaxkv_sglang.cache.sglang.cache_source import SGLANG_CACHE_SOURCES, by_cache_source
from relaxkv_sglang.forward.fold import publish_misses
from relaxkv_sglang.forward.report import merge_record, request_record

if TYPE_CHECKING:
    from relaxkv_sglang.forward.query_pass import ForwardSetup
    from relaxkv_sglang.forward.repair_stage import RepairStage
    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache


def finish_forward(cache: "RelaxKVCache", setup: "ForwardSetup", stage: Optional["RepairStage"]) -> None:
    """Publish miss chunks (unless the repair ``stage`` did), count reuse, attach reports (``stage.outcomes``:
    what the repair did per batch index)."""
    if stage is None or not stage.published:
        publish_misses(cache, (r.fold for r in setup.requests))
    outcomes = stage.outcomes if stage is not None else {}
    totals = dict.fromkeys(SGLANG_CACHE_SOURCES, 0)
    for i, r in enumerate(setup.requests):
        f = r.fold
        sources = by_cache_source(f.hit_sources())
        if f.hit_tokens and not getattr(f.req, "retracted_stain", False):
            # Added to SGLang's radix-match counts; as in SGLang only the first prefill counts (a
            # retracted request's prefill again reuses the same chunks).
            f.req.cached_tokens += f.hit_tokens
            for source, tokens in sources.items():
                setattr(f.req, f"cached_tokens_{source}", getattr(f.req, f"cached_tokens_{source}") + tokens)
        for source, tokens in sources.items():
            totals[source] += tokens
        if f.plan is not None:
            merge_record(f.req, request_record(r, outcomes.get(i)))
    # Read after the forward by SGLang's prefill log line and sglang:cache_hit_rate; admission
    # counted reused chunk tokens as new input.
    stats = getattr(setup.source, "prefill_stats", None)
    hits = sum(totals.values())
    if stats is not None and hits:
        stats.log_hit_tokens += hits
        stats.log_device_hit_tokens += totals["device"]
        stats.log_host_hit_tokens += totals["host"]
        stats.log_storage_hit_tokens += totals["storage"]
        stats.log_input_tokens -= hits
    cache.update_metrics()
