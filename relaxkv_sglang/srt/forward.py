"""Folding chunk reuse into SGLang's extend batch.

The scheduler plans a request with chunks like any other: its extend covers
every token after the exact radix prefix, and it allocates a KV slot for each
(so the memory budget counts the request's private copy of every chunk). Just
before the forward pass, :func:`plan_fold` decides per request, for each chunk
inside the extend window:

* **hit** (the chunk tree holds it): copy its canonical K/V into the request's
  slots, re-rotating K by ``delta = position - canonical_start``, and drop its
  tokens from the batch, so they cost no projection, attention or MLP;
* **miss**: keep its tokens, computed position-independently (each attends only
  to its own chunk, see ``attention_backend``), and after the forward copy their
  K/V into fresh slots owned by the chunk tree (:func:`finish_fold`).

Prefix, glue and query tokens are computed as usual, attending to everything
before them. The last token of each request's window, and any token whose
input logprob was asked for, are always computed normally (SGLang needs their
logits). The folded batch is a shallow copy of the scheduled one with fewer
rows, the same pattern as SGLang's ``model_executor/encoder_swa_replay.py``.

SGLang files touched (via hooks registered in ``plugin.py``):
``managers/tp_worker.py`` ``TpModelWorker.forward_batch_generation`` (around) and
``model_executor/forward_batch_info.py`` ``ForwardBatch.init_new`` (around).
"""

from __future__ import annotations

import dataclasses
from copy import copy
from typing import Optional

import torch

from relaxkv_sglang.core.rope import RopeSpec, rotate_keys
from relaxkv_sglang.srt.plan import RECORD_KEY, RequestPlan, request_plan

_ACTIVE_FOLD: Optional["Fold"] = None


def active_fold() -> Optional["Fold"]:
    """The fold of the forward pass running now, if any (one scheduler thread)."""
    return _ACTIVE_FOLD


@dataclasses.dataclass
class RequestFold:
    """What the fold does to one request of the batch.

    Attributes:
        req: SGLang's ``Req``.
        req_pool_idx: its row in ``req_to_token``.
        window_start: first position of this extend window (SGLang's prefix length).
        keep: int64 [n_kept] window offsets of the tokens computed in this forward.
        scope_start: int64 [n_kept] first key position each kept token may attend to.
        hit_tokens / chunks_seen / chunks_hit: reuse counted for this window.
        inserts: miss chunks to copy into the chunk tree after the forward,
            as (token ids, start position, end position).
    """

    req: object
    req_pool_idx: int
    window_start: int
    window_len: int
    keep: torch.Tensor
    scope_start: torch.Tensor
    plan: RequestPlan | None
    logprob_start: int | None = None
    hit_tokens: int = 0
    chunks_seen: int = 0
    chunks_hit: int = 0
    inserts: list = dataclasses.field(default_factory=list)
    repair_rows: object = None  # repair.RequestRows of the repair pass, if repaired
    n_eligible: int = 0
    query_pass_rows: int = 0  # rows the repair's query pass computed before the forward

    @property
    def positions(self) -> torch.Tensor:
        return self.keep + self.window_start

    def report(self) -> dict:
        record = {
            "policy": self.plan.policy if self.plan else "prefix",
            "chunks_seen": self.chunks_seen,
            "chunks_hit": self.chunks_hit,
            "chunk_tokens_reused": self.hit_tokens,
            "tokens_computed": int(self.keep.shape[0]) + self.query_pass_rows,
            "repaired": self.repair_rows is not None,
        }
        if self.repair_rows is not None:
            from relaxkv_sglang.srt.repair import repair_report

            record.update(repair_report(self))
        return record


@dataclasses.dataclass
class Fold:
    """A folded extend batch: the scheduled batch minus the reused chunk tokens."""

    source: object  # the ScheduleBatch the scheduler built
    batch: object  # its shallow copy with fewer rows, fed to ForwardBatch.init_new
    requests: list[RequestFold]

    def positions(self) -> torch.Tensor:
        """int64 [n_rows] absolute position of every row of the folded batch."""
        return torch.cat([r.positions for r in self.requests])

    def extend_rows(self):
        from relaxkv_sglang.srt.attention_backend import ExtendRows

        rows, start = [], 0
        for r in self.requests:
            rows.append(ExtendRows(r.req_pool_idx, start, r.positions, r.scope_start))
            start += r.keep.shape[0]
        return rows


class KVCopier:
    """Copies K/V rows between pool slots for every layer, re-rotating K."""

    def __init__(self, kv_pool, rope: RopeSpec):
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


def _fold_one(cache, req, rp: int, pre: int, n: int, logprob_start: int | None) -> RequestFold:
    plan = request_plan(req)
    keep = torch.ones(n, dtype=torch.bool)
    scope = torch.zeros(n, dtype=torch.int64)
    fold = RequestFold(req, rp, pre, n, keep, scope, plan, logprob_start)
    if plan is None or not plan.reuses_chunks:
        fold.keep = torch.arange(n, dtype=torch.int64)
        return fold
    req_to_token = cache.req_to_token_pool.req_to_token
    end = pre + n
    for cs, ce in plan.chunk_spans:
        if cs < pre or ce > end:
            continue  # partly before or after this window: computed normally (exact)
        fold.chunks_seen += 1
        tokens = req.origin_input_ids[cs:ce]
        entry = cache.chunks.lookup(plan.namespace, tokens)
        if entry is not None:
            cache.chunks.lock(entry)
            try:
                dst = req_to_token[rp, cs:ce].to(torch.int64)
                cache.copier.copy(entry.slots, dst, cs - entry.canonical_start)
            finally:
                cache.chunks.unlock(entry)
            keep[cs - pre : ce - pre] = False
            fold.chunks_hit += 1
            fold.hit_tokens += ce - cs
        else:
            scope[cs - pre : ce - pre] = cs
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


def plan_fold(cache, batch) -> Optional[Fold]:
    """Decide, copy reused KV, and build the folded batch; None if no request has a plan."""
    if batch is None or not batch.forward_mode.is_extend() or batch.forward_mode.is_mixed():
        return None
    if all(request_plan(r) is None for r in batch.reqs):
        return None
    logprob_starts = batch.extend_logprob_start_lens if batch.return_logprob else None
    pool_idx = batch.req_pool_indices_cpu.tolist()
    requests = [
        _fold_one(cache, req, pool_idx[i], batch.prefix_lens[i], batch.extend_lens[i],
                  logprob_starts[i] if logprob_starts is not None else None)
        for i, req in enumerate(batch.reqs)
    ]
    unchanged = all(r.keep.shape[0] == n for r, n in zip(requests, batch.extend_lens))
    return Fold(batch, batch if unchanged else _folded_copy(batch, requests), requests)


def _folded_copy(batch, requests: list[RequestFold]):
    offsets, start = [], 0
    for r, n in zip(requests, batch.extend_lens):
        offsets.append(r.keep + start)
        start += n
    rows = torch.cat(offsets)
    folded = copy(batch)
    folded.input_ids = batch.input_ids[rows.to(batch.input_ids.device)]
    folded.out_cache_loc = batch.out_cache_loc[rows.to(batch.out_cache_loc.device)]
    if batch.prefill_input_ids_cpu is not None:
        folded.prefill_input_ids_cpu = batch.prefill_input_ids_cpu[rows]
    new_lens = [int(r.keep.shape[0]) for r in requests]
    if batch.extend_logprob_start_lens is not None:
        # Input-logprob rows were all kept, so their count is unchanged.
        folded.extend_logprob_start_lens = [
            new - (old - start) for new, old, start in zip(new_lens, batch.extend_lens, batch.extend_logprob_start_lens)
        ]
    folded.extend_lens = new_lens
    folded.extend_num_tokens = sum(new_lens)
    if getattr(batch, "global_num_tokens", None) is not None:
        raise RuntimeError("relaxkv: data-parallel attention is not supported with chunk reuse")
    return folded


def publish_misses(cache, r: RequestFold) -> None:
    """Copy the request's freshly computed miss chunks into slots the chunk tree owns."""
    req_to_token = cache.req_to_token_pool.req_to_token
    for tokens, cs, ce in r.inserts:
        if cache.chunks.peek(r.plan.namespace, tokens) is not None:
            continue  # another request in this batch published it first
        slots = cache.alloc_chunk_slots(ce - cs)
        if slots is None:
            continue  # no room even after eviction: a cache may skip an insert
        cache.copier.copy(req_to_token[r.req_pool_idx, cs:ce].to(torch.int64), slots, 0)
        cache.chunks.insert(r.plan.namespace, tokens, slots, canonical_start=cs)
    r.inserts = []


def finish_fold(cache, fold: Fold) -> None:
    """After the forward: publish miss chunks to the chunk tree, count reuse."""
    for r in fold.requests:
        publish_misses(cache, r)
        if r.hit_tokens:
            r.req.cached_tokens += r.hit_tokens
        if r.plan is not None:
            _publish_record(r.req, r.report())
    # SGLang's prefill log line and /metrics sglang:cache_hit_rate read these
    # after the forward; admission counted reused chunk tokens as new input.
    stats = getattr(fold.source, "prefill_stats", None)
    hits = sum(r.hit_tokens for r in fold.requests)
    if stats is not None and hits:
        stats.log_hit_tokens += hits
        stats.log_device_hit_tokens += hits
        stats.log_input_tokens -= hits
    cache.publish_metrics()


def _publish_record(req, step: dict) -> None:
    """Merge this prefill step's report into the request's ``meta_info.relaxkv``.

    SGLang carries ``req.customized_info`` to the HTTP process; the key is
    declared request-level (see :func:`around_is_request_level_key`), so the
    record is sent once, not sliced per output token.
    """
    info = req.customized_info if req.customized_info is not None else {}
    old = info.get(RECORD_KEY, [None])[-1]
    if old is not None:
        for key in ("chunks_seen", "chunks_hit", "chunk_tokens_reused", "tokens_computed"):
            step[key] += old[key]
    info[RECORD_KEY] = [step]
    req.customized_info = info


def around_is_request_level_key(original, streamer, key: str) -> bool:
    """Hook on ``SchedulerOutputStreamer.is_request_level_customized_info_key``."""
    return key == RECORD_KEY or original(streamer, key)


# ------------------------------------------------------------------ the hooks


def around_forward_batch_generation(original, worker, batch=None, *args, **kwargs):
    """Hook on ``TpModelWorker.forward_batch_generation``: fold, forward, finish."""
    global _ACTIVE_FOLD
    from relaxkv_sglang.srt import repair
    from relaxkv_sglang.srt.tree_cache import active_cache

    cache = active_cache()
    fold = plan_fold(cache, batch) if cache is not None else None
    if fold is None:
        return original(worker, batch, *args, **kwargs)
    repair_rows = repair.prepare_repair(cache, worker.model_runner, fold)
    if repair_rows is not None:
        fold.batch = _folded_copy(batch, fold.requests)
    _ACTIVE_FOLD = fold
    repair.set_active_pass(repair_rows)
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        _ACTIVE_FOLD = None
        repair.set_active_pass(None)
    finish_fold(cache, fold)
    return result


def around_forward_batch_init_new(original, cls, batch, model_runner, *args, **kwargs):
    """Hook on the classmethod ``ForwardBatch.init_new``: build it from the folded batch."""
    fold = _ACTIVE_FOLD
    if fold is None or batch is not fold.source:
        return original(cls, batch, model_runner, *args, **kwargs)
    forward_batch = original(cls, fold.batch, model_runner, *args, **kwargs)
    positions = fold.positions()
    forward_batch.positions = positions.to(forward_batch.positions.dtype).to(forward_batch.positions.device)
    return forward_batch
