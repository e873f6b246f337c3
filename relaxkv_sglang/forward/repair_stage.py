"""The forward's third stage: :class:`RepairStage`, run by the decoder stack's hook after SGLang's layers (whose
forward was the repair's query pass), plans each target's anchors
(:func:`~relaxkv_sglang.repair.anchor_schedule.schedule_anchors`) and runs the repair pass
(:class:`~relaxkv_sglang.repair.sglang.layer_loop.LayerLoop`), whose glue and query rows replace SGLang's. It runs
in the window holding the prompt's last token, over the whole prompt, so a cold request equals its warm one
whatever the windows; an unplannable request is served as ``pic``.

SGLang files touched: the ``forward`` of each decoder-stack class the model-family registry hooks
(``model/model_family.py::hooked_model_classes``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from relaxkv_sglang.forward.budget import decide_budget
from relaxkv_sglang.forward.fold import publish_misses
from relaxkv_sglang.model.model_family import hooked_model_classes
from relaxkv_sglang.model.sglang.model_layers import ModelLayers
from relaxkv_sglang.model.tensor_parallel import place_shard
from relaxkv_sglang.repair.anchor_schedule import AnchorSchedule, schedule_anchors
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.sglang.layer_loop import LayerLoop, LoopRows
from relaxkv_sglang.repair.sglang.services import RepairServices
from relaxkv_sglang.runtime import records
from relaxkv_sglang.runtime.failures import InvariantError, served_as_pic
from relaxkv_sglang.runtime.hooks import Hook

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from relaxkv_sglang.forward.query_pass import ForwardSetup, RequestRows
    from relaxkv_sglang.cache.sglang.relaxkv_cache import RelaxKVCache


@dataclasses.dataclass(frozen=True)
class RepairOutcome:
    """What the repair did for one request: its pass's ``rows`` (None: served as pic) and the budget's fields."""

    rows: Optional[LoopRows]
    not_repaired_reason: Optional[str] = None
    budget_report: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RepairTiming:
    """The tree cache's record: the repair stages run on this rank and their wall time (collectives included)."""

    stages: int = 0
    seconds: float = 0.0


def repair_stage(cache: "RelaxKVCache", services: Optional[RepairServices],
                 setup: "ForwardSetup") -> Optional["RepairStage"]:
    """The batch's repair, when some request is to be repaired in this forward (else None)."""
    if not setup.targets:
        return None
    if services is None:
        raise InvariantError("relaxkv: a request is to be repaired but startup built no repair services")
    return RepairStage(cache, services, setup)


def request_repair_config(r: "RequestRows", base: RepairConfig) -> RepairConfig:
    """``base`` (the served calibration's) with the request's own ratios."""
    plan = r.fold.plan
    given = {"anchor_ratio": plan.anchor_ratio, "context_ratio": plan.context_ratio}
    return dataclasses.replace(base, **{knob: value for knob, value in given.items() if value is not None})


class RepairStage:
    """The batch's repair of ``setup``'s targets; ``outcomes`` (batch index -> :class:`RepairOutcome`) outlives
    :meth:`run` because SGLang's forward returns only hidden states."""

    def __init__(self, cache: "RelaxKVCache", services: RepairServices, setup: "ForwardSetup") -> None:
        self.cache = cache
        self.services = services
        self.setup = setup
        self.outcomes: dict[int, RepairOutcome] = {}
        self.published = False  # the batch's misses (fold.publish_misses), before the anchors overwrite them

    def run(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n_rows, hidden] SGLang's final-normed output of the folded batch -> the same,
        the targets' glue and query rows replaced by the repair pass's (its wall time counted on the cache)."""
        start = time.perf_counter()
        try:
            return self._run(model, hidden)
        finally:
            timing = records.record(self.cache, RepairTiming)
            timing.stages += 1
            timing.seconds += time.perf_counter() - start

    def _run(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        publish_misses(self.cache, (r.fold for r in self.setup.requests))
        self.published = True
        layers = ModelLayers(model)
        signals = self._decision_signals(hidden, layers)
        planned = []
        for i in self.setup.targets:
            r = self.setup.requests[i]
            self.outcomes[i] = self._plan(r, layers.n_layers, *signals.get(i, (None, None)))
            if self.outcomes[i].rows is not None:
                planned.append((i, r, self.outcomes[i].rows))
        if not planned:
            return hidden
        ids = torch.cat([_token_ids(r.fold.req)[rows.positions] for _, r, rows in planned])
        loop = LayerLoop(layers, self.services.kv_pool, self.services.anchor_attention, rope=self.services.rope)
        with torch.no_grad():
            repaired = loop.run([rows for _, _, rows in planned], ids.to(hidden.device))
        offset = 0
        for i, r, rows in planned:
            _replace_rows(hidden, self.setup.row_starts[i], r.positions, repaired[offset: offset + rows.n_rows], rows)
            offset += rows.n_rows
        return hidden

    def _decision_signals(self, hidden: torch.Tensor,
                          layers: ModelLayers) -> dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Per scored target: (float32 [n_layers, n_context] the query's attention mass, float32 [vocab] the answer
        logits or None), the ranks' shares summed in one collective so every rank plans from the same values."""
        ranks = layers.ranks
        scored = [i for i in self.setup.targets if self.setup.requests[i].scores is not None]
        shares = [(self.setup.requests[i].scores.stacked(layers.n_layers), self._answer_logits(hidden, i))
                  for i in scored]
        if ranks.size > 1 and shares:
            pieces = [t if j == 0 else place_shard(t, ranks)
                      for share in shares for j, t in enumerate(share) if t is not None]
            summed = ranks.sum(torch.cat([t.flatten() for t in pieces]).to(hidden.device)).cpu()
            summed_pieces = iter(torch.split(summed, [t.numel() for t in pieces]))
            shares = [(next(summed_pieces).view(scores.shape), next(summed_pieces) if logits is not None else None)
                      for scores, logits in shares]
        vocab = self.services.vocab_size
        return {i: (scores, logits[:vocab] if logits is not None else None)
                for i, (scores, logits) in zip(scored, shares)}

    def _answer_logits(self, hidden: torch.Tensor, i: int) -> Optional[torch.Tensor]:
        """float32 [vocab shard] this rank's query-pass logits at request ``i``'s last row (None: no LM head): the
        budget signal, computed for every scored request (fixed-ratio runs fit calibrations)."""
        lm_head = self.services.lm_head
        if lm_head is None:
            return None
        last = self.setup.row_starts[i] + self.setup.requests[i].n_rows - 1
        weight = lm_head.weight  # [this rank's vocab shard, hidden]
        return torch.nn.functional.linear(hidden[last].to(weight.dtype), weight).float().cpu()

    def _plan(self, r: "RequestRows", n_layers: int, scores: Optional[torch.Tensor],
              answer_logits: Optional[torch.Tensor]) -> RepairOutcome:
        """Plan the request's pass (``scores``, ``answer_logits``: :meth:`_decision_signals`); served as pic when
        it cannot be planned."""
        f = r.fold
        try:
            ids = _token_ids(f.req)
            served = self.services.calibration
            budget = decide_budget(request_repair_config(r, served.base), f.plan, served, scores, ids, answer_logits)
            anchor_schedule = schedule_anchors(f.plan.policy, scores, list(f.plan.chunk_spans), f.plan.query_start,
                                               n_layers, budget.config, self.services.cost, input_ids=ids)
            # the pass's bookkeeping lives on the host (layer_loop): the slots are read back once
            return RepairOutcome(repair_rows(f.window_end, anchor_schedule, r.slots.cpu()), budget_report=budget.report)
        except InvariantError:
            raise
        except Exception as exc:
            return RepairOutcome(None, served_as_pic(f.req, f"its repair could not be planned ({exc})"))


def _replace_rows(hidden: torch.Tensor, start: int, batch_positions: torch.Tensor, repaired: torch.Tensor,
                  rows: LoopRows) -> None:
    """Write one request's repaired glue and query rows (``repaired`` [rows.n_rows, hidden]) in place over its rows
    of ``hidden`` [n_batch_rows, hidden] from row ``start``; batch_positions int64 [n] their positions."""
    fresh = (~rows.anchor).nonzero().flatten()
    pos = rows.positions[fresh]
    idx = torch.searchsorted(batch_positions, pos).clamp(max=batch_positions.shape[0] - 1)
    present = batch_positions[idx] == pos  # glue of earlier windows is not in this batch
    if not bool(present[-1]) or int(pos[-1]) != int(batch_positions[-1]):
        raise InvariantError("relaxkv: the repair pass does not end at the request's last row")
    hidden[(start + idx[present]).to(hidden.device)] = repaired[fresh[present].to(repaired.device)].to(hidden.dtype)


def _token_ids(req: "Req") -> torch.Tensor:
    """int64 [prompt + generated tokens] (a retracted request's prefill again covers its generated tokens)."""
    ids = getattr(req, "full_untruncated_fill_ids", None)
    return torch.tensor(ids if ids is not None and len(ids) else req.origin_input_ids, dtype=torch.int64)


def repair_rows(end: int, anchor_schedule: AnchorSchedule, slots: torch.Tensor) -> LoopRows:
    """One request's pass rows up to position ``end`` (the window's end), in position order: anchors (until their
    exit layer), glue and query (every layer); slots int64 host [>= end] the request's pool slots."""
    n_context = anchor_schedule.n_context
    exit_of = anchor_schedule.exit_layers()
    in_chunk = torch.zeros(end, dtype=torch.bool)
    for s, e in anchor_schedule.chunk_spans:
        in_chunk[s:e] = True
    glue_and_query = torch.arange(anchor_schedule.chunk_spans[0][0], end)
    glue_and_query = glue_and_query[~in_chunk[glue_and_query]]
    anchors = (exit_of > 0).nonzero().flatten()
    positions, order = torch.sort(torch.cat([anchors, glue_and_query]))
    is_anchor = order < anchors.shape[0]
    exits = torch.where(is_anchor, exit_of[positions.clamp(max=n_context - 1)],
                        torch.tensor(anchor_schedule.n_layers))
    return LoopRows(slots=slots, positions=positions, exits=exits, scope=torch.zeros_like(positions),
                    anchor=is_anchor, anchor_schedule=anchor_schedule)


def around_model_forward(original: Callable, model: torch.nn.Module, input_ids: torch.Tensor,
                         positions: torch.Tensor, forward_batch: "ForwardBatch", *args: Any, **kwargs: Any) -> Any:
    """Hook on each registered family's decoder-stack ``forward``: SGLang's forward (a repair's query pass), then
    :class:`RepairStage`, which replaces the repaired requests' glue and query rows of the output."""
    hidden = original(model, input_ids, positions, forward_batch, *args, **kwargs)
    stage = records.record(model, RepairStage, create=False)
    if stage is None or not forward_batch.forward_mode.is_extend():
        return hidden
    if not isinstance(hidden, torch.Tensor):
        raise InvariantError("relaxkv: a repair needs the decoder stack's hidden states alone "
                           "(no auxiliary hidden states, no pipeline stages)")
    return stage.run(model, hidden)


#: the decoder-stack ``forward`` of each class the model-family registry hooks
HOOKS = tuple(Hook(f"{model_class}.forward", around_model_forward, ("self", "input_ids", "positions", "forward_batch"))
              for model_class in hooked_model_classes())
