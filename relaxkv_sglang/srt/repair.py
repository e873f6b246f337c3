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

**When**: in the extend window that holds the prompt's last token
(:attr:`~.fold.RequestFold.completes_prompt`). A prompt longer than SGLang's
``--chunked-prefill-size`` is prefilled in several windows; the earlier ones fold hits and
compute misses position-independently, as ``pic`` does (:mod:`.fold`), and the last one repairs
the whole prompt: the query pass runs this window's rows (plus any query rows of earlier windows,
for their scores) over the stale KV already in the request's slots, the plan covers every chunk,
and the repair pass's anchors, glue and query may be rows of earlier windows, whose stale KV
they overwrite layer by layer. The result does not depend on where the windows fell. A request
SGLang retracted under memory pressure is prefilled again with its generated tokens: the same
window repairs it again (the query's scores stop at the prompt's end; the generated tokens are
recomputed like the query). When a repair-policy request is not repaired, the report says why
(``not_repaired_reason``, :func:`not_repaired_reason`).

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


def decides_repair(r: "RequestFold") -> bool:
    """A repair-policy request with chunks, in the window that completes its prompt."""
    return r.plan is not None and r.plan.repairs and r.completes_prompt


def not_repaired_reason(r: "RequestFold", model_supports_repair: bool) -> Optional[str]:
    """Why a request that :func:`decides_repair` cannot be repaired in this window; None if it can."""
    if not model_supports_repair:
        return "the model's layer stack does not run through the repair pass (served as pic)"
    if r.logprob_start is not None:
        # The request's own start (earlier windows of a split prompt had their share already);
        # -1: none asked, SGLang's window offset then points past the window.
        asked = getattr(r.req, "logprob_start_len", -1)
        first = asked if isinstance(asked, int) and asked >= 0 else r.window_start + r.logprob_start
        if first < r.plan.query_start:
            return (f"input logprobs were asked from position {first}, before the query (position "
                    f"{r.plan.query_start}): a repair computes only the anchors, glue and query (served as pic)")
    return None


def prepare_repair(cache: "ChunkCache", model_runner: "ModelRunner", fold: "Fold") -> Optional[list[LoopRows]]:
    """Run the query pass and plan the batch's repair requests (module doc).

    Each repaired ``RequestFold`` takes the repair pass's rows (``use_repair``). Returns the
    repair pass's rows for every request of the batch (a request not repaired runs its folded
    rows at every layer), or None when no request is repaired in this window.
    """
    candidates = [r for r in fold.requests if decides_repair(r)]
    if not candidates:
        return None
    model_ok = supports_repair(model_runner.model)
    targets = []
    for r in candidates:
        r.not_repaired_reason = not_repaired_reason(r, model_ok)
        if r.not_repaired_reason is None:
            targets.append(r)
    if not targets:
        return None
    layers = ModelLayers(model_runner.model.model)
    loop = LayerLoop(layers, cache.kv_pool, model_runner.attn_backend.anchor_attention)
    n_layers = layers.n_layers

    passes = [_query_pass_rows(cache, r, n_layers) for r in targets]
    ids = torch.cat([_token_ids(r.req)[rows.positions] for r, rows in zip(targets, passes)])
    with torch.no_grad():
        loop.run(passes, ids.to(model_runner.device))

    for r, query_pass in zip(targets, passes):
        r.publish_misses(cache)
        anchor_plan = plan_anchors(
            r.plan.policy, torch.stack(query_pass.scores) if query_pass.want_scores else None,
            list(r.plan.chunk_spans), r.plan.query_start, n_layers, repair_config(r),
            model_runner.attn_backend.repair_cost)
        r.use_repair(_repair_rows(r, anchor_plan, query_pass.slots), query_pass.n_rows)
    return [r.repair if r.repair is not None else _folded_rows(cache, r, n_layers) for r in fold.requests]


def _token_ids(req: Any) -> torch.Tensor:
    """int64 [prompt + generated tokens] the request's token ids (a retracted request's prefill
    again covers its generated tokens too)."""
    ids = getattr(req, "full_untruncated_fill_ids", None)
    return torch.tensor(ids if ids is not None and len(ids) else req.origin_input_ids, dtype=torch.int64)


def _query_pass_rows(cache: "ChunkCache", r: "RequestFold", n_layers: int) -> LoopRows:
    """The query pass: this window's folded rows, plus, for a policy that scores, the query rows
    of earlier windows.

    Rows of earlier windows already hold their stale KV; only the query's own rows must run
    again, since their queries give the scores (recomputing them writes the same KV).
    """
    rows = _folded_rows(cache, r, n_layers)
    rows.want_scores = Policy(r.plan.policy).needs_query_scores
    earlier_query = torch.arange(min(r.plan.query_start, r.window_start), r.window_start, dtype=torch.int64)
    if rows.want_scores and earlier_query.numel():
        n = earlier_query.shape[0]
        rows.positions = torch.cat([earlier_query, rows.positions])
        rows.exits = torch.cat([torch.full((n,), n_layers, dtype=torch.int64), rows.exits])
        rows.scope = torch.cat([torch.zeros(n, dtype=torch.int64), rows.scope])
        rows.anchor = torch.cat([torch.zeros(n, dtype=torch.bool), rows.anchor])
    rows.n_context = r.plan.query_start
    rows.query_end = len(r.req.origin_input_ids)
    return rows


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
