"""Folding chunk reuse into SGLang's extend batch.

The scheduler plans a request with chunks like any other: its extend covers
every token after the exact radix prefix, and it allocates a KV slot for each
(so the memory budget counts the request's private copy of every chunk). Just
before the forward pass, :func:`fold_batch` decides per request, for each chunk
inside the extend window:

* **hit** (the chunk tree holds it): the cache copies its canonical K/V into the
  request's slots, re-rotating K to where the chunk now sits
  (:meth:`~.tree_cache.ChunkCache.reuse_chunk`), and its tokens are dropped from
  the batch, so they cost no projection, attention or MLP;
* **miss**: its tokens stay, computed position-independently (each attends only
  to its own chunk, see ``attention_backend``), and after the forward the cache
  copies their K/V into slots the chunk tree owns (:meth:`RequestFold.publish_misses`).

Prefix, glue and query tokens are computed as usual, attending to everything
before them. The last token of each request's window, and any token whose
input logprob was asked for, are always computed normally (SGLang needs their
logits).

**Prompts split across prefill windows** (SGLang's chunked prefill): a chunk is
looked up in the window that holds the token right after it (the prompt's last
window for a chunk ending the prompt), so that window's last row is never a
reused one. Until then its rows are computed position-independently, like a
miss; a hit then overwrites their KV with the cached chunk's, so the chunk's KV
is the same however the prompt was split. A repair runs in the window holding
the prompt's last token (:attr:`RequestFold.completes_prompt`), over the whole
prompt (:mod:`.repair`); that window's batch also recomputes the query's rows of
earlier windows, for its scores (negative ``keep`` offsets, their KV already in
the request's slots).

The folded batch is a shallow copy of the scheduled one with fewer rows, the
same pattern as SGLang's ``model_executor/encoder_swa_replay.py``.

This module decides and keeps the books; the hooks that call it are in
:mod:`.forward`, the repair that may replace a request's rows in :mod:`.repair`.
"""

from __future__ import annotations

import dataclasses
from copy import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

from relaxkv_sglang.core.tiers import TierName, split_hits
from relaxkv_sglang.srt.cache_source import SGLANG_CACHE_SOURCES, by_cache_source
from relaxkv_sglang.srt.context import ExtendRows, ForwardContext, InvariantError, QueryScores, Repair
from relaxkv_sglang.srt.plan import RequestPlan, request_plan
from relaxkv_sglang.srt.report import merge_record, request_record

if TYPE_CHECKING:
    from relaxkv_sglang.srt.layer_loop import LoopRows
    from relaxkv_sglang.srt.tree_cache import ChunkCache


@dataclasses.dataclass
class RequestFold:
    """What the fold does to one request of the batch.

    Attributes:
        req: SGLang's ``Req``.
        req_pool_idx: its row in ``req_to_token``.
        window_start: first position of this extend window (SGLang's prefix length).
        window_len: tokens in this extend window.
        keep: int64 [n_kept] window offsets of the tokens computed in this forward.
        scope_start: int64 [n_kept] first key position each kept token may attend to.
        plan: the request's plan (None: a plain request in a folded batch).
        logprob_start: window offset input logprobs start at, if asked.
        hit_tokens / chunks_seen / chunks_hit: reuse counted for this window.
        tier_tokens: of the hit tokens, those of chunks loaded from a lower tier
            (lower :class:`~relaxkv_sglang.core.tiers.TierName` -> tokens); the rest came from the device pool.
        inserts: miss chunks to publish after they are computed,
            as (token ids, start position, end position).
        scores: the query's attention per layer, recorded by the attention backend while
            SGLang's forward computes the rows (the repair's query pass; policies that score).
        slots: int64 [window_end] the request's KV-pool slots, once it is to be repaired (rows of
            earlier windows in the batch read theirs from it).
        repair: the repair pass's rows, once this request is repaired.
        not_repaired_reason: why a repair-policy request was not repaired in the window
            that completes its prompt (None: repaired, or not decided in this window).
    """

    req: Any
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
    inserts: list[tuple[tuple[int, ...], int, int]] = dataclasses.field(default_factory=list)
    scores: Optional[QueryScores] = None
    slots: Optional[torch.Tensor] = None
    repair: Optional["LoopRows"] = None
    not_repaired_reason: Optional[str] = None

    @property
    def positions(self) -> torch.Tensor:
        """int64 [n_kept] absolute positions of the kept tokens."""
        return self.keep + self.window_start

    @property
    def window_end(self) -> int:
        """One past the last prompt position this extend window covers."""
        return self.window_start + self.window_len

    @property
    def completes_prompt(self) -> bool:
        """This window holds the prompt's last token: the window that decides the repair
        (the last of a split prompt; also a retracted request's prefill again, whose window
        runs on over its generated tokens)."""
        return self.window_start < len(self.req.origin_input_ids) <= self.window_end

    @property
    def rows_computed(self) -> int:
        """Rows this forward computes for the request: the batch's, plus the repair pass's."""
        return int(self.keep.shape[0]) + (self.repair.n_rows if self.repair is not None else 0)

    def start_query_pass(self, slots: torch.Tensor, scores: Optional[QueryScores],
                         earlier_query: torch.Tensor) -> None:
        """Before the forward, for a request to be repaired: SGLang's forward over its rows is
        the repair's query pass.

        Args:
            slots: int64 [window_end] the request's slots.
            scores: the recorder of the query's attention (None: the policy does not score).
            earlier_query: int64 [n] positions of the query's rows in earlier windows (a split
                prompt), added to the batch with scope 0 (negative ``keep`` offsets;
                :func:`_folded_copy` reads their token ids and slots from the request), so that
                the whole query is in the pass; recomputing them writes the same KV.
        """
        self.slots, self.scores = slots, scores
        if earlier_query.numel():
            self.keep = torch.cat([earlier_query - self.window_start, self.keep])
            self.scope_start = torch.cat([torch.zeros_like(earlier_query), self.scope_start])

    def hit_sources(self) -> dict[TierName, int]:
        """The window's chunk hit tokens by the tier they came from (device: the pool), summing to
        ``hit_tokens`` (:func:`~relaxkv_sglang.core.tiers.split_hits`)."""
        return split_hits(self.hit_tokens, self.tier_tokens)

    def publish_misses(self, cache: "ChunkCache") -> None:
        """Once the miss chunks' KV is computed: hand each to the chunk tree (at most once)."""
        row = cache.req_to_token[self.req_pool_idx]
        for tokens, cs, ce in self.inserts:
            cache.publish_chunk(self.plan.namespace, tokens, row[cs:ce].to(torch.int64), cs)
        self.inserts = []


@dataclasses.dataclass
class Fold:
    """A folded extend batch: the scheduled batch minus the reused chunk tokens."""

    source: Any  # the ScheduleBatch the scheduler built
    requests: list[RequestFold]

    @property
    def unchanged(self) -> bool:
        """Every request keeps exactly its window's rows (the batch can run as scheduled)."""
        # keep is ascending and distinct: n rows from offset 0 to n - 1 are the window itself.
        return all(r.keep.shape[0] == n and (n == 0 or (int(r.keep[0]) == 0 and int(r.keep[-1]) == n - 1))
                   for r, n in zip(self.requests, self.source.extend_lens))

    def positions(self) -> torch.Tensor:
        """int64 [n_rows] absolute position of every row of the folded batch."""
        return torch.cat([r.positions for r in self.requests])

    def extend_rows(self) -> list[ExtendRows]:
        """Each request's rows, in batch order, for the attention backend."""
        return [ExtendRows(r.req_pool_idx, start, r.positions, r.scope_start, r.scores)
                for r, start in zip(self.requests, self.row_starts())]

    def row_starts(self) -> list[int]:
        """First row of each request in the folded batch."""
        starts, start = [], 0
        for r in self.requests:
            starts.append(start)
            start += int(r.keep.shape[0])
        return starts

    def context(self, repair: Optional[Repair]) -> ForwardContext:
        """What the attention backend and the model hook read during the forward."""
        return ForwardContext(self.positions(), self.extend_rows(), repair)

    def batch(self) -> Any:
        """The batch to build the ForwardBatch from: the source, or its copy with the kept rows."""
        return self.source if self.unchanged else _folded_copy(self.source, self.requests)


def fold_batch(cache: "ChunkCache", batch: Any) -> Optional[Fold]:
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
    return Fold(batch, requests)


def settles_in_window(chunk_end: int, window_start: int, window_end: int, prompt_len: int) -> bool:
    """Whether a chunk ending at ``chunk_end`` is looked up (copied on a hit, published on a
    miss) in the extend window ``[window_start, window_end)``: the window holding the token
    right after it, or, for a chunk that ends the prompt, the window holding its last token
    (module doc). Exactly one window of a prefill settles each chunk."""
    return (window_start <= chunk_end < window_end
            or (chunk_end == prompt_len and window_start < chunk_end <= window_end))


def _fold_request(cache: "ChunkCache", req: Any, rp: int, pre: int, n: int,
                  logprob_start: Optional[int]) -> RequestFold:
    plan = request_plan(req)
    keep = torch.ones(n, dtype=torch.bool)
    scope = torch.zeros(n, dtype=torch.int64)
    fold = RequestFold(req, rp, pre, n, keep, scope, plan, logprob_start)
    if plan is None or not plan.reuses_chunks:
        fold.keep = torch.arange(n, dtype=torch.int64)
        return fold
    row = cache.req_to_token[rp]
    end, prompt_len = pre + n, len(req.origin_input_ids)
    for cs, ce in plan.chunk_spans:
        lo, hi = max(cs, pre) - pre, max(min(ce, end) - pre, 0)  # this window's rows of the chunk
        if not settles_in_window(ce, pre, end, prompt_len):
            if cs < end and ce > pre:
                scope[lo:hi] = cs  # computed position-independently until then
            continue
        fold.chunks_seen += 1
        tokens = req.origin_input_ids[cs:ce]
        tier = cache.reuse_chunk(plan.namespace, tokens, row[cs:ce].to(torch.int64), cs)
        if tier:
            keep[lo:hi] = False  # rows of earlier windows: their KV is overwritten by the copy
            fold.chunks_hit += 1
            fold.hit_tokens += hi - lo
            if tier != TierName.DEVICE:  # loaded from a lower tier (tree_cache: lower tiers)
                fold.tier_tokens[tier] = fold.tier_tokens.get(tier, 0) + hi - lo
        else:
            scope[lo:hi] = cs
            fold.inserts.append((tuple(tokens), cs, ce))
    # SGLang reads logits at the window's last row and input logprobs from
    # `logprob_start` on; those rows must be computed, normally.
    must = n - 1 if logprob_start is None else min(logprob_start, n - 1)
    for i in range(must, n):
        if not keep[i]:
            keep[i] = True
            scope[i] = 0
            fold.hit_tokens -= 1
    fold.keep = keep.nonzero().flatten()
    fold.scope_start = scope[fold.keep]
    return fold


def _folded_copy(batch: Any, requests: list[RequestFold]) -> Any:
    """A shallow copy of the ScheduleBatch holding only the kept rows.

    A repaired request's query rows of earlier windows (negative ``keep``) are not in the
    scheduled batch: their token ids come from the request, their slots from its
    ``req_to_token`` row (``RequestFold.slots``), appended after the batch's rows and indexed
    from there.
    """
    if getattr(batch, "global_num_tokens", None) is not None:
        raise InvariantError("relaxkv: data-parallel attention is not supported with chunk reuse")
    offsets, start, total = [], 0, sum(batch.extend_lens)
    extra_ids, extra_locs, n_extra = [], [], 0
    for r, n in zip(requests, batch.extend_lens):
        rows = r.keep + start
        before = r.keep < 0
        if bool(before.any()):
            pos = r.positions[before]
            extra_ids.append(torch.tensor(r.req.origin_input_ids[: r.window_start], dtype=torch.int64)[pos])
            extra_locs.append(r.slots[pos])
            rows = rows.clone()
            rows[before] = total + n_extra + torch.arange(pos.shape[0])
            n_extra += pos.shape[0]
        offsets.append(rows)
        start += n
    rows = torch.cat(offsets)
    input_ids, out_cache_loc, cpu_ids = batch.input_ids, batch.out_cache_loc, batch.prefill_input_ids_cpu
    if extra_ids:
        ids = torch.cat(extra_ids)
        input_ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        out_cache_loc = torch.cat([out_cache_loc, torch.cat(extra_locs).to(out_cache_loc.device, out_cache_loc.dtype)])
        if cpu_ids is not None:
            cpu_ids = torch.cat([cpu_ids, ids.to(cpu_ids.dtype)])
    folded = copy(batch)
    folded.input_ids = input_ids[rows.to(input_ids.device)]
    folded.out_cache_loc = out_cache_loc[rows.to(out_cache_loc.device)]
    if cpu_ids is not None:
        folded.prefill_input_ids_cpu = cpu_ids[rows]
    new_lens = [int(r.keep.shape[0]) for r in requests]
    if batch.extend_logprob_start_lens is not None:
        # Input-logprob rows were all kept, so their count is unchanged.
        folded.extend_logprob_start_lens = [
            new - (old - start) for new, old, start in zip(new_lens, batch.extend_lens, batch.extend_logprob_start_lens)
        ]
    folded.extend_lens = new_lens
    folded.extend_num_tokens = sum(new_lens)
    return folded


def finish_fold(cache: "ChunkCache", fold: Fold) -> None:
    """After the forward: publish miss chunks to the chunk tree, count reuse, attach reports."""
    totals = dict.fromkeys(SGLANG_CACHE_SOURCES, 0)
    for r in fold.requests:
        r.publish_misses(cache)
        sources = by_cache_source(r.hit_sources())
        if r.hit_tokens and not getattr(r.req, "retracted_stain", False):
            # SGLang's cached_tokens_details and sglang:cached_tokens_total{cache_source=...} read
            # cached_tokens_{device,host,storage}, which its own accounting has already set from
            # the radix match: chunk hits are added by the tier they were loaded from. Like
            # SGLang's own count, only the first prefill counts (a retracted request's prefill
            # again reuses the same chunks).
            r.req.cached_tokens += r.hit_tokens
            for source, tokens in sources.items():
                setattr(r.req, f"cached_tokens_{source}", getattr(r.req, f"cached_tokens_{source}") + tokens)
        for source, tokens in sources.items():
            totals[source] += tokens
        if r.plan is not None:
            merge_record(r.req, request_record(r))
    # SGLang's prefill log line, /metrics sglang:cache_hit_rate and
    # sglang:prefill_effective_tokens_total read these after the forward; admission counted
    # reused chunk tokens as new input.
    stats = getattr(fold.source, "prefill_stats", None)
    hits = sum(totals.values())
    if stats is not None and hits:
        stats.log_hit_tokens += hits
        stats.log_device_hit_tokens += totals["device"]
        stats.log_host_hit_tokens += totals["host"]
        stats.log_storage_hit_tokens += totals["storage"]
        stats.log_input_tokens -= hits
    cache.update_metrics()
