"""The repair planner: one request's decisions (anchors per layer, their contexts), made once.

The planner turns what the query pass measured into an :class:`AnchorPlan`; an executor (the
torch reference in :mod:`.reference`, the server's ``srt/forward/layer_loop.py``) only runs it, so both
make the same decisions from the same inputs.

Inputs (absolute prompt positions, as in :mod:`.token_sets`): a repairing ``policy`` (its
:class:`~.policies.PolicySpec`); ``scores`` float [n_layers, n_context], the query's stale
attention s_l (or None); ``chunk_spans`` sorted inside ``[0, n_context)``; a
:class:`~.repair_config.RepairConfig`; the prompt's ids when the chunk sinks or the markup are
sized from them.

Decisions: targets ``A_0 ⊇ A_1 ⊇ ...`` (:func:`~.selection.select_anchors`, i.e. an exit layer
``e(t)`` per token) and each layer's context (:func:`relaxed_context`, a
:class:`~.layout.RelaxedContextSpec`; the full causal prefix for the peers and ``relaxkv_fullctx``).
A policy that ``needs_kv_deviation`` (CacheBlend) recomputes every eligible token at layers ``0..check_layer``, then
:meth:`AnchorPlan.after_check_layer` decides the rest from the measured deviation.

The knobs, the cost model and the joint budget's split: :mod:`.repair_config`.

Randomness: targets from ``RepairConfig.seed``, contexts from ``seed + 1``. Why these defaults:
docs/experiments/INDEX.md#anchor-ratio, #context-ratio, #attention-overhead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from .layout import (BlockSparseLayout, RelaxedContextSpec, build_relaxed_layout, build_relaxed_layouts,
                     key_bound_page_scores)
from .policies import Policy, PolicySpec, policy_spec
from .repair_config import RepairConfig, RepairCost, split_budget
from .selection import anchor_ratio_achieved, kv_deviation, select_anchors
from .token_sets import chunk_ids, eligible_tokens, shared_opening_sinks, shared_runs
from .stale_shift import shift_body

Span = tuple[int, int]

__all__ = ["AnchorPlan", "plan_anchors", "anchor_layouts", "relaxed_context"]


@dataclasses.dataclass
class AnchorPlan:
    """One request's repair decisions.

    Attributes:
        policy: the repair policy.
        chunk_spans: the reused chunks.
        n_context: context tokens (the query starts here).
        n_layers: layers of the model.
        config: the knobs it was planned with.
        scores: float [n_layers, n_context] s_l, or None.
        anchor_sets: per planned layer, int64 [|A_l|] sorted anchors (nested). CacheBlend's
            plan holds only layers ``0..check_layer`` until :meth:`after_check_layer`.
        layouts: per planned layer, the anchors' layout (rows = ``anchor_sets[l]``).
        chunk_sinks: int64 [n_chunks] each chunk's sink tokens (``RelaxKVOptions.chunk_sink_rule``).
    """

    policy: Policy
    chunk_spans: tuple[Span, ...]
    n_context: int
    n_layers: int
    config: RepairConfig
    scores: Optional[torch.Tensor]
    anchor_sets: list[torch.Tensor]
    layouts: list[BlockSparseLayout]
    chunk_sinks: torch.Tensor

    @property
    def spec(self) -> PolicySpec:
        """What the policy declares (``policies.POLICY_SPECS``)."""
        return policy_spec(self.policy)

    @property
    def n_eligible(self) -> int:
        return int(eligible_tokens(self.chunk_spans, self.n_context).numel())

    @property
    def check_layer(self) -> int:
        """The layer a mid-forward decision is made at (``CacheBlendOptions.check_layer``)."""
        return self.config.cacheblend.check_layer

    @property
    def awaits_check_layer(self) -> bool:
        """A mid-forward policy (CacheBlend) before its check layer has run: later layers are not
        decided yet."""
        return len(self.anchor_sets) < self.n_layers

    def exit_layers(self) -> torch.Tensor:
        """int64 [n_context]: e(t), the layers ``[0, e(t))`` token t is recomputed at (0: never)."""
        exits = torch.zeros(self.n_context, dtype=torch.int64)
        for l, anchors in enumerate(self.anchor_sets):
            exits[anchors] = l + 1
        return exits

    def achieved_anchor_ratio(self) -> float:
        return anchor_ratio_achieved(self.anchor_sets, self.n_eligible)

    def decides_at(self, layer: int) -> bool:
        """True at the check layer of a policy that decides mid-forward (its spec's
        ``decides_mid_forward``: CacheBlend) while the later layers are undecided."""
        return self.spec.decides_mid_forward and self.awaits_check_layer and layer == self.check_layer

    @property
    def stale_shift(self) -> str:
        """The stale shift the executor applies (:mod:`.stale_shift`): the config's for the relaxkv
        policies, ``none`` for the peers (they run as published)."""
        return self.config.relaxkv.stale_shift if self.spec.stale_shift else "none"

    @property
    def stale_shift_scale(self) -> float:
        """The fraction of the anchors' mean deviation the stale shift adds (``RelaxKVOptions``)."""
        return self.config.relaxkv.stale_shift_scale

    def shift_sets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(S_l, T_l) of :mod:`.stale_shift` at ``layer``: the anchors whose deviation is averaged
        and the tokens shifted, int64 sorted positions (both empty when the plan does not shift)."""
        recomputed = self._shift_body_exits > layer
        return self.shift_body[recomputed], self.shift_body[~recomputed]

    def shift_sources(self, layer: int) -> torch.Tensor:
        """int64 [|S_l|]: the first of :meth:`shift_sets` alone (what the server's loop needs)."""
        return self.shift_body[self._shift_body_exits > layer]

    @functools.cached_property
    def shift_body(self) -> torch.Tensor:
        """int64 [n_body]: the tokens every layer's shift sets split (``stale_shift.shift_body``),
        computed once; empty when the plan does not shift."""
        if self.stale_shift == "none":
            return torch.zeros(0, dtype=torch.long)
        return shift_body(self.chunk_spans, self.n_context, self.chunk_sinks)

    @property
    def stale_shift_prior(self) -> float:
        """The weight of the request's mean in each group's shift (``RelaxKVOptions``)."""
        return self.config.relaxkv.stale_shift_prior

    @functools.cached_property
    def shift_group_of(self) -> torch.Tensor:
        """int64 [n_context]: the stale-shift group of every context token (``RelaxKVOptions.
        stale_shift_group``): its chunk's index with ``chunk``, else 0 (one group); 0 outside the
        chunks (no shift lands there)."""
        if self.config.relaxkv.stale_shift_group != "chunk":
            return torch.zeros(self.n_context, dtype=torch.long)
        return chunk_ids(self.chunk_spans, self.n_context).clamp(min=0)

    @property
    def n_shift_groups(self) -> int:
        """How many groups :attr:`shift_group_of` numbers."""
        return len(self.chunk_spans) if self.config.relaxkv.stale_shift_group == "chunk" else 1

    @functools.cached_property
    def _shift_body_exits(self) -> torch.Tensor:
        """int64 [n_body]: each body token's exit layer; the sets are nested, so S_l is the body
        tokens recomputed past ``l`` (``exits > l``), no per-layer set search."""
        return self.exit_layers()[self.shift_body]

    @functools.cached_property
    def context(self) -> RelaxedContextSpec:
        """The anchors' relaxed context (:func:`relaxed_context` of the plan's policy and config)."""
        return relaxed_context(self.policy, self.chunk_spans, self.n_context, self.config)

    @property
    def ranks_pages_in_layer(self) -> bool:
        """Whether :meth:`layout_at` decides the context in the layer (it needs the keys then)."""
        return self.config.relaxkv.context_rank != "query" and self.spec.context == "topk"

    def layout_at(self, layer: int, q_anchors: torch.Tensor, keys: torch.Tensor) -> BlockSparseLayout:
        """The anchors' layout at ``layer``, once their queries exist.

        With ``config.relaxkv.context_rank == "query"`` (or a policy whose context is not ranked) it is the
        planned ``layouts[layer]``; otherwise the same budget per row block filled with the pages
        the anchors' own queries rank highest (``layout.key_bound_page_scores``).

        Args:
            layer: the layer.
            q_anchors: [|A_l|, n_heads, d] the anchors' queries at this layer, rows in anchor order.
            keys: [n_context, n_kv_heads, d] the context's keys at this layer in prompt order,
                anchors' recomputed keys included.
        Returns:
            BlockSparseLayout whose rows are ``anchor_sets[layer]``.
        """
        planned = self.layouts[layer]
        if not self.ranks_pages_in_layer or planned.n_rows == 0:
            return planned
        # The layouts live on the host: an ablation that reads the layer's queries on a GPU
        # copies them back at every layer.
        row_scores = key_bound_page_scores(q_anchors.cpu(), planned.q_pos, keys.cpu(), self.n_context,
                                           self.context.page_size, exact=self.config.relaxkv.context_rank == "oracle")
        return build_relaxed_layout(self.anchor_sets[layer], None, self.context, row_page_scores=row_scores)

    def after_check_layer(self, tokens: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          k_stale: torch.Tensor, v_stale: torch.Tensor) -> "AnchorPlan":
        """CacheBlend: the full plan once the check layer has recomputed its tokens' K/V.

        Args:
            tokens: int64 [n] the tokens recomputed at the check layer.
            k_new, v_new: [n, Hkv, d] their recomputed K/V.
            k_stale, v_stale: [n, Hkv, d] their cached (stale) K/V.
        Returns:
            a new plan with every layer decided; layers ``0..check_layer`` unchanged.
        """
        # The plan lives on the host: K/V of a GPU pool are read back here, once per request.
        deviation = torch.zeros(self.n_context)
        deviation[tokens.cpu()] = kv_deviation(k_new, v_new, k_stale, v_stale, self.config.cacheblend.use_k).cpu()
        sets = select_anchors(self.policy, None, self.chunk_spans, self.n_context, self.config.anchor_ratio,
                              n_layers=self.n_layers, deviation=deviation, check_layer=self.check_layer)
        done = len(self.layouts)
        layouts = self.layouts + anchor_layouts(self.context, sets[done:], None, self.config.seed, first_layer=done)
        return dataclasses.replace(self, anchor_sets=sets, layouts=layouts)


def plan_anchors(
    policy: Policy | str,
    scores: Optional[torch.Tensor],
    chunk_spans: Sequence[Span],
    n_context: int,
    n_layers: int,
    config: RepairConfig,
    cost: Optional[RepairCost] = None,
    input_ids: Optional[torch.Tensor] = None,
) -> AnchorPlan:
    """Targets and contexts of one request (module doc).

    Args:
        policy: a repairing Policy or its value.
        scores: float [n_layers, n_context] s_l, required when ``policy.needs_query_scores``.
        chunk_spans: the reused chunks inside ``[0, n_context)``.
        n_context: context tokens.
        n_layers: layers of the model.
        config: the knobs.
        cost: the model's cost model; needed when ``config.budget`` is set.
        input_ids: int64 [>= n_context] the prompt; needed when ``config.relaxkv.chunk_sink_rule`` is
            ``shared`` or ``config.relaxkv.markup_share`` is above 0.
    Returns:
        AnchorPlan; with a budget, its ``config`` holds the split's anchor and context ratios.
    
    Example (relaxkv over two chunks, 4 layers, 25% anchors, half-prefix contexts):

    >>> import torch
    >>> scores = torch.rand(4, 64, generator=torch.Generator().manual_seed(0))
    >>> plan = plan_anchors("relaxkv", scores, [(8, 40), (40, 64)], 64, 4,
    ...                     RepairConfig(anchor_ratio=0.25, context_ratio=0.5, page_size=8))
    >>> sum(len(a) for a in plan.anchor_sets), plan.achieved_anchor_ratio()  # 25% of 4 x 56 token-layers
    (56, 0.25)
    >>> all(l.n_rows == len(a) for l, a in zip(plan.layouts, plan.anchor_sets))
    True
    """
    policy = Policy(policy)
    spans = tuple((int(s), int(e)) for s, e in chunk_spans)
    if config.budget is not None:
        if cost is None:
            raise ValueError("a repair budget needs the model's RepairCost")
        anchor_ratio, context_ratio = split_budget(config.budget, policy, spans, n_context, config, cost)
        config = dataclasses.replace(config, anchor_ratio=min(anchor_ratio, 1.0), context_ratio=context_ratio)
    chunk_sinks = plan_chunk_sinks(config, spans, input_ids)
    targets_rng = torch.Generator().manual_seed(config.seed)
    relaxkv = config.relaxkv
    sets = select_anchors(policy, scores, spans, n_context, config.anchor_ratio, targets_rng, n_layers=n_layers,
                          check_layer=config.cacheblend.check_layer, chunk_sink_tokens=chunk_sinks,
                          layer_value=relaxkv.layer_value, chunk_sink_share=relaxkv.chunk_sink_share,
                          chunk_sink_order=relaxkv.chunk_sink_order,
                          markup=plan_markup(config, spans, n_context, input_ids), markup_share=relaxkv.markup_share)
    layouts = anchor_layouts(relaxed_context(policy, spans, n_context, config), sets, scores, config.seed)
    return AnchorPlan(policy, spans, n_context, n_layers, config, scores, sets, layouts, chunk_sinks)


def plan_chunk_sinks(config: RepairConfig, chunk_spans: Sequence[Span],
                     input_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 [n_chunks]: each chunk's sink tokens under ``config.relaxkv.chunk_sink_rule``."""
    if config.relaxkv.chunk_sink_rule == "fixed":
        return torch.full((len(chunk_spans),), config.relaxkv.chunk_sink_tokens, dtype=torch.long)
    if input_ids is None:
        raise ValueError("chunk_sink_rule='shared' needs the prompt's input_ids")
    return shared_opening_sinks(input_ids, chunk_spans, config.relaxkv.chunk_sink_tokens)


def plan_markup(config: RepairConfig, chunk_spans: Sequence[Span], n_context: int,
                input_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """bool [n_context] the template markup every chunk repeats, or None when
    ``config.relaxkv.markup_share`` is 0 (``exit_layers`` module doc)."""
    if config.relaxkv.markup_share <= 0:
        return None
    if input_ids is None:
        raise ValueError("markup_share above 0 needs the prompt's input_ids")
    return shared_runs(input_ids, chunk_spans, n_context)


def relaxed_context(policy: Policy, chunk_spans: Sequence[Span], n_context: int,
                    config: RepairConfig) -> RelaxedContextSpec:
    """The anchors' context of ``policy`` under ``config``: relaxed for relaxkv (and its random
    ablation), the full causal prefix for the others (ratio 1)."""
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
    """Each layer's anchors' layout in ``context`` (:func:`relaxed_context`).

    Args:
        context: the request's anchor context.
        anchor_sets: the sets of layers ``first_layer, first_layer + 1, ...``.
        scores: float [n_layers, n_context] or None (needed by the 'topk' context).
        seed: ``RepairConfig.seed``; mode 'random' draws its page orders from ``seed + 1``.
    Returns:
        one layout per set.
    """
    context_rng = torch.Generator().manual_seed(seed + 1)
    topk = scores is not None and context.mode == "topk"
    layer_scores = scores[first_layer:first_layer + len(anchor_sets)] if topk else None
    return build_relaxed_layouts(anchor_sets, layer_scores, context, context_rng)
