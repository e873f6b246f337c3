"""Cache repair inside SGLang's prefill: the query pass, then the planner's decisions as loop rows.

For a batch holding a request under a repair policy (``epic``, ``cacheblend``, ``prophetkv``,
``relaxkv`` and the ablations), :func:`prepare_repair` runs before the scheduled forward:

1. **Query pass**: the prompt's computed rows (exact prefix tail, chunk misses computed
   position-independently, glue, query) run through :class:`~.layer_loop.LayerLoop` over the
   stale reused KV. It writes their KV and records, per layer, the query's attention mass on
   every context token (``s_l``).
2. Misses are now final position-independent KV: the chunk tree gets them.
3. **Plan**: :func:`~relaxkv_sglang.core.repair_plan.plan_anchors` (the same planner the torch
   reference uses) chooses each layer's anchors and their contexts from ``s_l``.
4. The request's rows become the repair pass's: anchors (leaving at their exit layer), glue
   and query. The scheduled forward then runs the layer loop over them instead of the model's
   own (:func:`~.layer_loop.around_model_forward`), and SGLang samples as usual.

This module decides which requests are repaired and translates plans into rows; the method's
decisions are in ``core/``, the execution in :mod:`.layer_loop`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from relaxkv_sglang.core.policies import Policy
from relaxkv_sglang.core.repair_plan import AnchorPlan, RepairConfig, plan_anchors
from relaxkv_sglang.srt.layer_loop import LayerLoop, LoopRows, ModelLayers, supports_repair

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

    from relaxkv_sglang.srt.fold import Fold, RequestFold
    from relaxkv_sglang.srt.tree_cache import ChunkCache


def repair_config(r: "RequestFold") -> RepairConfig:
    """The request's knobs (the rest are the defaults every executor shares)."""
    return RepairConfig(anchor_ratio=r.plan.anchor_ratio, context_ratio=r.plan.context_ratio, budget=r.plan.budget)


def is_repairable(r: "RequestFold") -> bool:
    """Repair needs the whole rest of the prompt, and at least one chunk, in this extend window."""
    plan = r.plan
    if plan is None or not plan.repairs:
        return False
    in_window = [s for s in plan.chunk_spans if s[0] >= r.window_start]
    logprobs_ok = r.logprob_start is None or r.window_start + r.logprob_start >= plan.query_start
    return r.window_end == len(r.req.origin_input_ids) and bool(in_window) and logprobs_ok


def prepare_repair(cache: "ChunkCache", model_runner: "ModelRunner", fold: "Fold") -> Optional[list[LoopRows]]:
    """Run the query pass and plan the batch's repair requests (module doc).

    Each repaired ``RequestFold`` takes the repair pass's rows (``use_repair``). Returns the
    repair pass's rows for every request of the batch (a request not repaired runs its folded
    rows at every layer), or None when no request is repaired in this window.
    """
    targets = [r for r in fold.requests if is_repairable(r)]
    if not targets or not supports_repair(model_runner.model):
        return None
    layers = ModelLayers(model_runner.model.model)
    loop = LayerLoop(layers, cache.kv_pool, model_runner.attn_backend.anchor_attention)
    n_layers = layers.n_layers

    passes = []
    for r in targets:
        rows = _folded_rows(cache, r, n_layers)
        rows.n_context = r.plan.query_start
        rows.want_scores = Policy(r.plan.policy).needs_query_scores
        passes.append(rows)
    ids = torch.cat([torch.tensor(r.req.origin_input_ids)[r.positions] for r in targets])
    with torch.no_grad():
        loop.run(passes, ids.to(model_runner.device))

    for r, query_pass in zip(targets, passes):
        r.publish_misses(cache)
        anchor_plan = plan_anchors(
            r.plan.policy, torch.stack(query_pass.scores) if query_pass.want_scores else None,
            _spans_in_window(r), r.plan.query_start, n_layers, repair_config(r), model_runner.attn_backend.repair_cost)
        r.use_repair(_repair_rows(r, anchor_plan, query_pass.slots), query_pass.n_rows)
    return [r.repair if r.repair is not None else _folded_rows(cache, r, n_layers) for r in fold.requests]


def _spans_in_window(r: "RequestFold") -> list[tuple[int, int]]:
    return [s for s in r.plan.chunk_spans if s[0] >= r.window_start]


def _folded_rows(cache: "ChunkCache", r: "RequestFold", n_layers: int) -> LoopRows:
    """The request's folded rows, each at every layer with its own scope (no anchors)."""
    n = r.positions.shape[0]
    return LoopRows(
        slots=cache.req_to_token[r.req_pool_idx, : r.window_end].to(torch.int64),
        positions=r.positions, exits=torch.full((n,), n_layers, dtype=torch.int64),
        scope=r.scope_start.clone(), anchor=torch.zeros(n, dtype=torch.bool),
    )


def _repair_rows(r: "RequestFold", anchor_plan: AnchorPlan, slots: torch.Tensor) -> LoopRows:
    """Anchors (until their exit layer), glue and query (every layer), in position order."""
    n_context, end = anchor_plan.n_context, r.window_end
    exit_of = anchor_plan.exit_layers()
    in_chunk = torch.zeros(end, dtype=torch.bool)
    for s, e in anchor_plan.chunk_spans:
        in_chunk[s:e] = True
    glue_and_query = torch.arange(anchor_plan.chunk_spans[0][0], end)
    glue_and_query = glue_and_query[~in_chunk[glue_and_query]]
    anchors = (exit_of > 0).nonzero().flatten()
    positions, order = torch.sort(torch.cat([anchors, glue_and_query]))
    is_anchor = order < anchors.shape[0]
    exits = torch.where(is_anchor, exit_of[positions.clamp(max=n_context - 1)],
                        torch.tensor(anchor_plan.n_layers))
    return LoopRows(slots=slots, positions=positions, exits=exits, scope=torch.zeros_like(positions),
                    anchor=is_anchor, anchor_plan=anchor_plan, n_context=n_context)
