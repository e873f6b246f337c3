"""A request's repair budget in the scheduler: its own setting or the server's, and for ``auto`` the
anchor ratio chosen from its query pass (:mod:`relaxkv_sglang.repair.auto_budget`).

``auto`` needs the query's stale attention, the budget model and, for a model that reads it, the query pass's
answer (under tensor parallelism, every rank's vocabulary shard gathered by the repair stage); without them the
request keeps the anchor ratio it would have had and ``budget_choice.fallback`` says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from relaxkv_sglang.repair.auto_budget import budget_signal
from relaxkv_sglang.runtime.quality import AUTO
from relaxkv_sglang.repair.repair_config import RepairConfig
from relaxkv_sglang.repair.sglang.served_calibration import ServedCalibration
from relaxkv_sglang.request.plan import RequestPlan


@dataclasses.dataclass(frozen=True)
class BudgetDecision:
    """What the budget made of a request's config (to plan with) and its ``meta_info.relaxkv`` fields."""

    config: RepairConfig
    report: dict[str, Any]


def request_budget(plan: RequestPlan, served: ServedCalibration) -> float | str | None:
    """The request's ``relaxkv_budget``, else (no anchor ratio given either) ``RELAXKV_DEFAULT_BUDGET``, else None."""
    if plan.budget is not None:
        return plan.budget
    return served.default_budget if plan.anchor_ratio is None else None


def decide_budget(config: RepairConfig, plan: RequestPlan, served: ServedCalibration, scores: Optional[torch.Tensor],
                  input_ids: torch.Tensor, answer_logits: Optional[torch.Tensor] = None) -> BudgetDecision:
    """The request's budget applied to ``config``; ``scores`` float [n_layers, n_context] the query's stale
    attention (None: not recorded), ``input_ids`` int64 [>= n_context], ``answer_logits`` float [vocab] (or None)."""
    budget = request_budget(plan, served)
    signal = (budget_signal(scores, plan.chunk_spans, plan.query_start, input_ids, answer_logits)
              if scores is not None else None)
    report: dict[str, Any] = {"budget": budget}
    if signal is not None:
        report["budget_signal"] = signal.to_json()
    if budget != AUTO:
        return BudgetDecision(dataclasses.replace(config, budget=budget) if budget is not None else config, report)
    quality = plan.quality if plan.quality is not None else served.quality
    model = served.budget_model
    if model is None or signal is None or (model.reads_answer and signal.answer_entropy is None):
        why = (f"no budget model in {served.model or 'the model'}'s calibration" if model is None
               else f"policy {plan.policy} records no query scores" if signal is None
               else "the query pass's answer was not measured (no LM head on the worker)")
        report["budget_choice"] = {"mode": AUTO, "quality": quality, "anchor_ratio": config.anchor_ratio,
                                   "fallback": f"{why}: the anchor ratio it would have had"}
        return BudgetDecision(dataclasses.replace(config, budget=None), report)
    choice = model.choose(signal, quality)
    report["budget_choice"] = choice.to_json()
    return BudgetDecision(dataclasses.replace(config, anchor_ratio=choice.anchor_ratio, budget=None), report)
