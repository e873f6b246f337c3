"""Cache repair inside SGLang's prefill: SGLang's forward is the query pass, then the anchors.

A batch holding a request under a repair policy (``epic``, ``cacheblend``, ``prophetkv``,
``relaxkv`` and the ablations) runs its repair inside the one scheduled forward, in two passes:

1. **Query pass: SGLang's own forward** over the fold's rows, exactly the rows ``pic`` computes
   (the exact prefix's tail, chunk misses each attending only to its own chunk, glue and query
   over the stale reused KV), through the ``relaxkv`` attention backend (torch SDPA on a CPU,
   FlashInfer on a GPU). It writes their KV; for a policy that scores, the backend also records
   the query's attention mass on every context token at each layer (``s_l``,
   :class:`~.context.QueryScores`). :func:`prepare_repair` sets this up before the forward.
2. **Repair** (:class:`RepairStage`), run by the model hook once SGLang's decoder stack has
   computed the rows (:func:`around_model_forward`): the misses are now final
   position-independent KV and go to the chunk tree; the planner
   (:func:`~relaxkv_sglang.core.repair_plan.plan_anchors`, the same one the torch reference
   uses) chooses each layer's anchors and their contexts from ``s_l``; the **repair pass**
   (:class:`~.layer_loop.LayerLoop`) runs only the rows that need it, anchors (leaving at their
   exit layer), glue and query, and its glue and query rows replace SGLang's in the hidden states
   the logits processor reads. SGLang samples as usual.

Every row is computed once by SGLang's forward; the layer loop computes only the repair. So a
cold request (chunks no request has cached) pays ``pic``'s forward plus the repair, and its
result is the one the same request gets on warm chunks: its misses' KV is what a later hit
copies, the query pass sees the same stale KV, and the plan and repair follow from them.

**When**: in the extend window that holds the prompt's last token
(:attr:`~.fold.RequestFold.completes_prompt`). A prompt longer than SGLang's
``--chunked-prefill-size`` is prefilled in several windows; the earlier ones fold hits and
compute misses position-independently, as ``pic`` does (:mod:`.fold`), and the last one repairs
the whole prompt: its query pass runs this window's rows plus any query rows of earlier windows
(for their scores) over the stale KV already in the request's slots, the plan covers every chunk,
and the repair pass's anchors and glue may be rows of earlier windows, whose stale KV they
overwrite layer by layer. The result does not depend on where the windows fell. A request
SGLang retracted under memory pressure is prefilled again with its generated tokens: the same
window repairs it again (the query's scores stop at the prompt's end; the generated tokens are
recomputed like the query). When a repair-policy request is not repaired, the report says why
(``not_repaired_reason``, :func:`not_repaired_reason`).

**One request never stops the server.** A request whose repair cannot be set up or planned (its
query pass would not hold its whole query, or the planner or the rows' construction fails on it)
is served as ``pic``, its rows those SGLang's forward computed, with a ``not_repaired_reason``
naming the failure, logged once (:func:`serve_as_pic`); the batch's other requests are repaired
as before. Only a broken invariant of the plugin's own bookkeeping
(:class:`~.context.InvariantError`) leaves the scheduler, logged in one line by :mod:`.forward`.

This module decides which requests are repaired and translates plans into rows; the method's
decisions are in ``core/``, the execution in :mod:`.layer_loop`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from relaxkv_sglang.core.policies import Policy
from relaxkv_sglang.core.repair_plan import AnchorPlan, RepairConfig, plan_anchors
from relaxkv_sglang.srt.context import InvariantError, QueryScores, forward_context
from relaxkv_sglang.srt.layer_loop import LayerLoop, LoopRows, ModelLayers, supports_repair

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from relaxkv_sglang.srt.fold import Fold, RequestFold
    from relaxkv_sglang.srt.tree_cache import ChunkCache

logger = logging.getLogger(__name__)


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


def prepare_repair(cache: "ChunkCache", model_runner: "ModelRunner", fold: "Fold") -> Optional["RepairStage"]:
    """Before the forward: choose the batch's requests to repair and set up their query pass
    (module doc, step 1); the returned stage runs step 2 inside the forward. None when no request
    is repaired in this window."""
    candidates = [r for r in fold.requests if decides_repair(r)]
    if not candidates:
        return None
    model_ok = supports_repair(model_runner.model)
    targets = [r for r in candidates if _set_up_repair(cache, r, model_ok)]
    if not targets:
        return None
    return RepairStage(cache, model_runner.attn_backend, fold, targets)


def serve_as_pic(r: "RequestFold", failure: str) -> None:
    """A request whose repair cannot be carried out: served as ``pic`` (the rows SGLang's
    forward computed), the report and the log saying why (once: a request's repair is decided
    once per prefill of its prompt)."""
    r.repair = None
    r.not_repaired_reason = f"{failure} (served as pic)"
    logger.warning("relaxkv: request %s not repaired: %s", getattr(r.req, "rid", "?"), r.not_repaired_reason)


def _set_up_repair(cache: "ChunkCache", r: "RequestFold", model_supports_repair: bool) -> bool:
    """Whether the request is repaired in this window: its query pass set up, or else why not
    (``r.not_repaired_reason``; a failure of its own is served as pic, module doc)."""
    r.not_repaired_reason = not_repaired_reason(r, model_supports_repair)
    if r.not_repaired_reason is not None:
        return False
    try:
        _start_query_pass(cache, r)
    except InvariantError:
        raise
    except Exception as exc:  # this request's plan, not the server: serve it as pic
        serve_as_pic(r, f"its query pass could not be set up ({exc})")
        return False
    return True


def _start_query_pass(cache: "ChunkCache", r: "RequestFold") -> None:
    """The request's rows stay the fold's; a policy that scores records the query's attention,
    and needs the whole query in the pass: its rows of earlier windows are added (they already
    hold their stale KV; only the query's own rows give scores, and recomputing them writes the
    same KV). Raises ``ValueError`` when the pass would not hold the whole query (checked here,
    before the forward, so the attention backend's recorder never meets such a request)."""
    slots = cache.req_to_token[r.req_pool_idx, : r.window_end].to(torch.int64)
    query_start, query_end = r.plan.query_start, len(r.req.origin_input_ids)
    scores, earlier_query = None, torch.zeros(0, dtype=torch.int64)
    if Policy(r.plan.policy).needs_query_scores:
        scores = QueryScores(query_start, query_end, slots)
        earlier_query = torch.arange(min(query_start, r.window_start), r.window_start, dtype=torch.int64)
        _check_whole_query(torch.cat([earlier_query, r.positions]), query_start, query_end)
    r.start_query_pass(slots, scores, earlier_query)


def _check_whole_query(rows: torch.Tensor, query_start: int, query_end: int) -> None:
    """Raise ``ValueError`` unless the pass's rows (int64 positions) hold every query position
    ``[query_start, query_end)`` (what :class:`~.context.QueryScores` records)."""
    held = int(((rows >= query_start) & (rows < query_end)).sum())
    if not query_start < query_end or held != query_end - query_start:
        raise ValueError(f"the pass would hold {held} of the query's rows {query_start}..{query_end - 1}")


class RepairStage:
    """The batch's repair, run by the model hook after SGLang's forward (module doc, step 2).

    Args:
        cache: the worker's chunk cache (KV pool, publishing the misses).
        attn_backend: the worker's ``relaxkv`` attention backend (anchor executor, cost model).
        fold: the batch's fold (the rows of every request in SGLang's output).
        targets: the requests to repair, their query pass set up.
    """

    def __init__(self, cache: "ChunkCache", attn_backend: Any, fold: "Fold", targets: list["RequestFold"]) -> None:
        self.cache = cache
        self.attn_backend = attn_backend
        self.fold = fold
        self.targets = targets

    def run(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n_rows, hidden] SGLang's final-normed output of the folded batch -> the same,
        the targets' glue and query rows replaced by the repair pass's."""
        layers = ModelLayers(model)
        targets = [r for r in self.targets if self._planned(r, layers.n_layers)]
        if not targets:
            return hidden
        passes = [r.repair for r in targets]
        ids = torch.cat([_token_ids(r.req)[rows.positions] for r, rows in zip(targets, passes)])
        loop = LayerLoop(layers, self.cache.kv_pool, self.attn_backend.anchor_attention,
                         rope=getattr(getattr(self.cache, "pool_kv", None), "rope", None))
        with torch.no_grad():
            repaired = loop.run(passes, ids.to(hidden.device))
        start_of = {id(r): start for r, start in zip(self.fold.requests, self.fold.row_starts())}
        offset = 0
        for r, rows in zip(targets, passes):
            _replace_rows(hidden, start_of[id(r)], r.positions, repaired[offset: offset + rows.n_rows], rows)
            offset += rows.n_rows
        return hidden

    def _planned(self, r: "RequestFold", n_layers: int) -> bool:
        """Publish the request's misses (final position-independent KV, before anchors overwrite
        it) and plan its repair pass (``r.repair``); False, served as pic, when its plan cannot be
        made (module doc)."""
        r.publish_misses(self.cache)
        scores = r.scores.stacked(n_layers) if r.scores is not None else None
        try:
            anchor_plan = plan_anchors(r.plan.policy, scores, list(r.plan.chunk_spans), r.plan.query_start, n_layers,
                                       repair_config(r), self.attn_backend.repair_cost, input_ids=_token_ids(r.req))
            r.repair = _repair_rows(r, anchor_plan, r.slots)
        except InvariantError:
            raise
        except Exception as exc:  # this request's plan, not the server: serve it as pic
            serve_as_pic(r, f"its repair could not be planned ({exc})")
            return False
        return True


def _replace_rows(hidden: torch.Tensor, start: int, batch_positions: torch.Tensor, repaired: torch.Tensor,
                  rows: LoopRows) -> None:
    """Write one request's repaired glue and query rows over its rows of SGLang's output.

    Args:
        hidden: [n_batch_rows, hidden] modified in place.
        start: the request's first row in ``hidden``; batch_positions int64 [n] its rows' positions.
        repaired: [rows.n_rows, hidden] the repair pass's output; rows: its rows.
    """
    fresh = (~rows.anchor).nonzero().flatten()
    pos = rows.positions[fresh]
    idx = torch.searchsorted(batch_positions, pos).clamp(max=batch_positions.shape[0] - 1)
    present = batch_positions[idx] == pos  # glue of earlier windows is not in this batch
    if not bool(present[-1]) or int(pos[-1]) != int(batch_positions[-1]):
        raise InvariantError("relaxkv: the repair pass does not end at the request's last row")
    hidden[(start + idx[present]).to(hidden.device)] = repaired[fresh[present].to(repaired.device)].to(hidden.dtype)


def _token_ids(req: Any) -> torch.Tensor:
    """int64 [prompt + generated tokens] the request's token ids (a retracted request's prefill
    again covers its generated tokens too)."""
    ids = getattr(req, "full_untruncated_fill_ids", None)
    return torch.tensor(ids if ids is not None and len(ids) else req.origin_input_ids, dtype=torch.int64)


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
                    anchor=is_anchor, anchor_plan=anchor_plan)


def around_model_forward(original: Callable, model: torch.nn.Module, input_ids: torch.Tensor,
                         positions: torch.Tensor, forward_batch: "ForwardBatch", *args: Any, **kwargs: Any) -> Any:
    """Hook on ``LlamaModel.forward`` / ``Qwen2Model.forward``: SGLang's forward (for a batch
    with a repair, its query pass), then the repair, which replaces the repaired requests' glue
    and query rows of the output (:class:`~relaxkv_sglang.srt.repair.RepairStage`)."""
    hidden = original(model, input_ids, positions, forward_batch, *args, **kwargs)
    context = forward_context(model)
    if context is None or context.repair is None or not forward_batch.forward_mode.is_extend():
        return hidden
    if not isinstance(hidden, torch.Tensor):
        raise InvariantError("relaxkv: a repair needs the decoder stack's hidden states alone "
                           "(no auxiliary hidden states, no pipeline stages)")
    return context.repair.run(model, hidden)
