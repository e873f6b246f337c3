"""The forward's first stage: chunk reuse folded into SGLang's extend batch.

Per chunk in the extend window: a **hit** is copied into the request's slots and its rows leave the batch; a
**miss** keeps its rows, each attending only to its own chunk, and is published once computed. Rows SGLang
reads (the window's last, input logprobs) are always computed, a hit's at chunk scope, so logprobs never
depend on the cache.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from relaxkv_sglang.cache.chunk_key import ChunkKey
from relaxkv_sglang.cache.tiers import TierName, split_hits
from relaxkv_sglang.model.tensor_parallel import digest
from relaxkv_sglang.request.plan import RequestPlan, request_plan

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache

# A miss chunk to publish once computed: (its key, start position, end position).
MissChunk = tuple[ChunkKey, int, int]


@dataclasses.dataclass(frozen=True)
class RequestFold:
    """What the fold decided for one request: ``keep`` int64 [n_kept] the window offsets left to compute
    (ascending), ``scope_start`` int64 [n_kept] the first key position each may attend to; ``window_start``:
    SGLang's prefix length; ``plan`` None for a plain request; ``tier_tokens``: hit tokens per lower tier."""

    req: "Req"
    req_pool_idx: int
    window_start: int
    window_len: int
    keep: torch.Tensor
    scope_start: torch.Tensor
    plan: Optional[RequestPlan]
    logprob_start: Optional[int] = None
    hit_tokens: int = 0
    chunks_seen: int = 0
    chunks_hit: int = 0
    tier_tokens: dict[TierName, int] = dataclasses.field(default_factory=dict)
    misses: tuple[MissChunk, ...] = ()

    @property
    def window_end(self) -> int:
        """One past the last prompt position this extend window covers."""
        return self.window_start + self.window_len

    @property
    def completes_prompt(self) -> bool:
        """This window holds the prompt's last token (a retracted request's runs on): it decides the repair."""
        return self.window_start < len(self.req.origin_input_ids) <= self.window_end

    def hit_sources(self) -> dict[TierName, int]:
        """The window's chunk hit tokens by source tier, summing to ``hit_tokens``."""
        return split_hits(self.hit_tokens, self.tier_tokens)


@dataclasses.dataclass(frozen=True)
class Fold:
    """A batch's fold: the scheduled batch and, per request in batch order, what the fold decided."""

    source: "ScheduleBatch"  # the batch the scheduler built
    requests: tuple[RequestFold, ...]


def fold_digests(fold: Fold) -> list[int]:
    """Per request (batch order), a digest of what the fold decided (window, rows kept, scopes, hits): every
    tensor-parallel rank's store must decide alike, or SGLang's own collectives would see other rows."""
    return [digest(str(f.req.rid), f.window_start, f.window_len, f.keep, f.scope_start, f.hit_tokens, f.chunks_hit)
            for f in fold.requests]


def fold_batch(cache: "RelaxKVCache", batch: Optional["ScheduleBatch"]) -> Optional[Fold]:
    """Decide, copy reused KV; None if the batch is not an extend or no request has a plan."""
    if batch is None or not batch.forward_mode.is_extend() or batch.forward_mode.is_mixed():
        return None
    if all(request_plan(r) is None for r in batch.reqs):
        return None
    logprob_starts = batch.extend_logprob_start_lens if batch.return_logprob else None
    pool_idx = batch.req_pool_indices_cpu.tolist()
    requests = [
        _fold_request(cache, req, pool_idx[i], batch.prefix_lens[i], batch.extend_lens[i],
                      logprob_starts[i] if logprob_starts is not None else None)
        for i, req in enumerate(batch.reqs)
    ]
    return Fold(batch, tuple(requests))


def publish_misses(cache: "RelaxKVCache", folds: Iterable[RequestFold]) -> None:
    """Publish the requests' miss chunks into slots the cache owns: once per forward, after SGLang's layers computed
    them and before a repair's anchors overwrite them (so by the repair stage when one runs, else by finish)."""
    for f in folds:
        if f.misses:
            cache.publish_chunks(f.misses, f.req_pool_idx)


def settles_in_window(chunk_end: int, window_start: int, window_end: int, prompt_len: int) -> bool:
    """Whether the window ``[window_start, window_end)`` settles the chunk: the one holding the token
    after it, or its last token if it ends the prompt; exactly one window of a prefill does."""
    return (window_start <= chunk_end < window_end
            or (chunk_end == prompt_len and window_start < chunk_end <= window_end))


def _fold_request(cache: "RelaxKVCache", req: "Req", rp: int, pre: int, n: int,
                  logprob_start: Optional[int]) -> RequestFold:
    plan = request_plan(req)
    if plan is None or not plan.reuses_chunks:
        every = torch.arange(n, dtype=torch.int64)
        return RequestFold(req, rp, pre, n, every, torch.zeros(n, dtype=torch.int64), plan, logprob_start)
    keep = torch.ones(n, dtype=torch.bool)
    scope = torch.zeros(n, dtype=torch.int64)
    hit_tokens = chunks_seen = chunks_hit = 0
    tier_tokens: dict[TierName, int] = {}
    misses: list[MissChunk] = []
    row = cache.req_to_token[rp]
    end, prompt_len = pre + n, len(req.origin_input_ids)
    for cs, ce in plan.chunk_spans:
        lo, hi = max(cs, pre) - pre, max(min(ce, end) - pre, 0)  # this window's rows of the chunk
        if not settles_in_window(ce, pre, end, prompt_len):
            if cs < end and ce > pre:
                scope[lo:hi] = cs  # computed position-independently until then
            continue
        chunks_seen += 1
        key = ChunkKey(plan.namespace, req.origin_input_ids[cs:ce])
        tier = cache.reuse.reuse(key, row[cs:ce].to(torch.int64), cs)
        scope[lo:hi] = cs  # a hit row computed after all (input logprobs, below) keeps its chunk scope
        if tier:
            keep[lo:hi] = False  # rows of earlier windows: their KV is overwritten by the copy
            chunks_hit += 1
            hit_tokens += hi - lo
            if tier != TierName.DEVICE:  # loaded from a lower tier (tree_cache: lower tiers)
                tier_tokens[tier] = tier_tokens.get(tier, 0) + hi - lo
        else:
            misses.append((key, cs, ce))
    # Rows SGLang reads (last row, input logprobs) are computed; a hit row among them at its chunk
    # scope over the reused KV, the same computation cold and warm.
    must = n - 1 if logprob_start is None else min(logprob_start, n - 1)
    for i in range(must, n):
        if not keep[i]:
            keep[i] = True
            hit_tokens -= 1
    kept = keep.nonzero().flatten()
    return RequestFold(req, rp, pre, n, kept, scope[kept], plan, logprob_start, hit_tokens, chunks_seen,
                       chunks_hit, tier_tokens, tuple(misses))
