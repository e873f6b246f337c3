"""The anchors' schedule: one request's decisions (anchors per layer, their contexts), made once by the planner; an
executor (the torch reference, the server's layer loop) only runs it. A policy that decides mid-forward (CacheBlend)
plans the layers up to its step, which hands the rest to :meth:`AnchorSchedule.with_later_layers`. Targets draw from
``RepairConfig.seed``, contexts from ``seed + 1``. Why: docs/experiments/INDEX.md#anchor-ratio."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from relaxkv_sglang.attention.layout import (BlockSparseLayout, RelaxedContextSpec, build_relaxed_layout,
                                             build_relaxed_layouts, key_bound_page_scores)
from relaxkv_sglang.repair.policies import Policy, PolicySpec, policy_spec
from relaxkv_sglang.repair.policies.base import AnchorInputs, LayerStep
from relaxkv_sglang.repair.repair_config import RepairConfig, RepairCost, split_budget
from relaxkv_sglang.repair.selection import anchor_ratio_achieved, select_anchors
from relaxkv_sglang.repair.token_sets import anchor_budget, eligible_tokens, shared_opening_sinks, shared_runs

Span = tuple[int, int]

__all__ = ["AnchorSchedule", "schedule_anchors", "anchor_layouts", "relaxed_context"]


@dataclasses.dataclass
class AnchorSchedule:
    """One request's repair decisions: ``scores`` float [n_layers, n_context] s_l, or None; ``anchor_sets`` per planned
    layer int64 [|A_l|] sorted, nested, ``layouts`` their layouts; ``chunk_sinks`` int64 [n_chunks]."""

    spec: PolicySpec
    chunk_spans: tuple[Span, ...]
    n_context: int
    n_layers: int
    config: RepairConfig
    scores: Optional[torch.Tensor]
    anchor_sets: list[torch.Tensor]
    layouts: list[BlockSparseLayout]
    chunk_sinks: torch.Tensor

    @property
    def n_eligible(self) -> int:
        return int(eligible_tokens(self.chunk_spans, self.n_context).numel())

    @property
    def decided_layers(self) -> int:
        return len(self.anchor_sets)

    @functools.cached_property
    def layer_step(self) -> Optional[LayerStep]:
        make = self.spec.layer_step
        return make(self) if make is not None else None

    def exit_layers(self) -> torch.Tensor:
        exits = torch.zeros(self.n_context, dtype=torch.int64)
        for l, anchors in enumerate(self.anchor_sets):
            exits[anchors] = l + 1
        return exits

    def achieved_anchor_ratio(self) -> float:
        return anchor_ratio_achieved(self.anchor_sets, self.n_eligible)

    @functools.cached_property
    def context(self) -> RelaxedContextSpec:
        return relaxed_context(self.spec, self.chunk_spans, self.n_context, self.config)

    @property
    def ranks_pages_in_layer(self) -> bool:
        """Whether :meth:`layout_at` decides the context in the layer (it needs the keys then)."""
        return self.config.relaxkv.context_rank != "query" and self.spec.context == "topk"

    def layout_at(self, layer: int, q_anchors: torch.Tensor, keys: torch.Tensor) -> BlockSparseLayout:
        """The anchors' layout at ``layer`` once their queries exist: the planned one, or (``context_rank`` not
        ``query``) the same budget per row block filled with the pages the anchors' own queries rank highest.
        ``q_anchors`` [|A_l|, n_heads, d] in anchor order; ``keys`` [n_context, n_kv_heads, d] in prompt order."""
        planned = self.layouts[layer]
        if not self.ranks_pages_in_layer or planned.n_rows == 0:
            return planned
        # The layouts live on the host: an ablation that reads the layer's queries on a GPU
        # copies them back at every layer.
        row_scores = key_bound_page_scores(q_anchors.cpu(), planned.q_pos, keys.cpu(), self.n_context,
                                           self.context.page_size, exact=self.config.relaxkv.context_rank == "oracle")
        return build_relaxed_layout(self.anchor_sets[layer], None, self.context, row_page_scores=row_scores)

    def anchor_inputs(self) -> AnchorInputs:
        """What the policy's anchor rule read for this schedule (its step decides more from it)."""
        elig = eligible_tokens(self.chunk_spans, self.n_context)
        return AnchorInputs(self.scores, self.chunk_spans, self.n_context, self.n_layers, self.config.anchor_ratio,
                            elig, anchor_budget(self.config.anchor_ratio, elig.numel()),
                            options=self.config.options_of(self.spec), chunk_sink_tokens=self.chunk_sinks)

    def with_later_layers(self, later_sets: Sequence[torch.Tensor]) -> "AnchorSchedule":
        """The schedule once a mid-forward step has decided the layers after :attr:`decided_layers` - 1."""
        done = self.decided_layers
        if done + len(later_sets) != self.n_layers:
            raise ValueError(f"{self.spec.name}: {len(later_sets)} later sets for layers {done}..{self.n_layers - 1}")
        layouts = self.layouts + anchor_layouts(self.context, later_sets, None, self.config.seed, first_layer=done)
        return dataclasses.replace(self, anchor_sets=self.anchor_sets + list(later_sets), layouts=layouts)


def schedule_anchors(
    policy: Policy | str | PolicySpec,
    scores: Optional[torch.Tensor],
    chunk_spans: Sequence[Span],
    n_context: int,
    n_layers: int,
    config: RepairConfig,
    cost: Optional[RepairCost] = None,
    input_ids: Optional[torch.Tensor] = None,
) -> AnchorSchedule:
    """Targets and contexts of one request: ``scores`` float [n_layers, n_context] s_l; ``cost`` with a budget;
    ``input_ids`` int64 [>= n_context] with ``shared`` sinks or markup. Example (relaxkv, two chunks, 4 layers):

    >>> scores = torch.rand(4, 64, generator=torch.Generator().manual_seed(0))
    >>> s = schedule_anchors("relaxkv", scores, [(8, 40), (40, 64)], 64, 4,
    ...                      RepairConfig(anchor_ratio=0.25, context_ratio=0.5, page_size=8))
    >>> s.achieved_anchor_ratio(), all(l.n_rows == len(a) for l, a in zip(s.layouts, s.anchor_sets))
    (0.25, True)
    """
    spec = policy_spec(policy)
    spans = tuple((int(s), int(e)) for s, e in chunk_spans)
    if config.budget is not None:
        if cost is None:
            raise ValueError("a repair budget needs the model's RepairCost")
        anchor_ratio, context_ratio = split_budget(config.budget, spec, spans, n_context, config, cost)
        config = dataclasses.replace(config, anchor_ratio=min(anchor_ratio, 1.0), context_ratio=context_ratio)
    chunk_sinks = sinks_per_chunk(config, spans, input_ids)
    targets_rng = torch.Generator().manual_seed(config.seed)
    sets = select_anchors(spec, scores, spans, n_context, config.anchor_ratio, targets_rng, n_layers=n_layers,
                          options=config.options_of(spec), chunk_sink_tokens=chunk_sinks,
                          markup=template_markup(config, spans, n_context, input_ids))
    layouts = anchor_layouts(relaxed_context(spec, spans, n_context, config), sets, scores, config.seed)
    return AnchorSchedule(spec, spans, n_context, n_layers, config, scores, sets, layouts, chunk_sinks)


def sinks_per_chunk(config: RepairConfig, chunk_spans: Sequence[Span],
                     input_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 [n_chunks]: each chunk's sink tokens under ``config.relaxkv.chunk_sink_rule``."""
    if config.relaxkv.chunk_sink_rule == "fixed":
        return torch.full((len(chunk_spans),), config.relaxkv.chunk_sink_tokens, dtype=torch.long)
    if input_ids is None:
        raise ValueError("chunk_sink_rule='shared' needs the prompt's input_ids")
    return shared_opening_sinks(input_ids, chunk_spans, config.relaxkv.chunk_sink_tokens)


def template_markup(config: RepairConfig, chunk_spans: Sequence[Span], n_context: int,
                input_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """bool [n_context] the markup every chunk repeats, or None when ``markup_share`` is 0."""
    if config.relaxkv.markup_share <= 0:
        return None
    if input_ids is None:
        raise ValueError("markup_share above 0 needs the prompt's input_ids")
    return shared_runs(input_ids, chunk_spans, n_context)


def relaxed_context(policy: Policy | PolicySpec, chunk_spans: Sequence[Span], n_context: int,
                    config: RepairConfig) -> RelaxedContextSpec:
    """The anchors' context: relaxed for a ``topk`` or ``random`` context, else the full causal prefix (ratio 1)."""
    mode = policy_spec(policy).context
    return RelaxedContextSpec(chunk_spans, n_context, config.context_ratio if mode != "full" else 1.0,
                              config.page_size, config.sink_tokens, mode, config.relaxkv.own_chunk_in_budget)


def anchor_layouts(
    context: RelaxedContextSpec,
    anchor_sets: Sequence[torch.Tensor],
    scores: Optional[torch.Tensor],
    seed: int,
    first_layer: int = 0,
) -> list[BlockSparseLayout]:
    """The layouts of the sets of layers ``first_layer, ...``; ``scores`` float [n_layers, n_context] or None."""
    context_rng = torch.Generator().manual_seed(seed + 1)
    topk = scores is not None and context.mode == "topk"
    layer_scores = scores[first_layer:first_layer + len(anchor_sets)] if topk else None
    return build_relaxed_layouts(anchor_sets, layer_scores, context, context_rng)
