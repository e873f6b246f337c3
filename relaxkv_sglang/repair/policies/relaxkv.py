"""``relaxkv`` (the method): per-layer nested targets from the query's stale attention s_l (``exit_layers``), each
anchor attending to a relaxed, query-relevant part of its prefix (``layout``), and the stale shift (``stale_shift``,
through :class:`StaleShiftStep`). Its two ablations change the context only: the full causal prefix
(``relaxkv_fullctx``) or random pages of the same budget (``relaxkv_randctx``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from relaxkv_sglang.repair.policies.base import (AnchorInputs, LayerEdit, LayerRead, MeasuredKV, OptionGroup,
                                                 PolicySpec, ScheduleView, check_choice, check_unit)

if TYPE_CHECKING:
    import torch


__all__ = ["LAYER_VALUES", "SINK_ORDERS", "CHUNK_SINK_RULES", "CONTEXT_RANKS", "STALE_SHIFTS", "STALE_SHIFT_GROUPS",
           "RelaxKVOptions", "exit_layer_sets", "StaleShiftStep", "SPECS"]

# Values of the knobs below; the rules themselves are in exit_layers.py, layout.py and stale_shift.py.
LAYER_VALUES = ("uniform", "skip0", "depth", "ramp")
SINK_ORDERS = ("offset", "score")
CHUNK_SINK_RULES = ("fixed", "shared")
CONTEXT_RANKS = ("query", "keys", "oracle")
STALE_SHIFTS = ("none", "v", "kv")
STALE_SHIFT_GROUPS = ("request", "chunk")


@dataclasses.dataclass(frozen=True)
class RelaxKVOptions:
    """The relaxkv policies' own knobs (why each default: docs/experiments/INDEX.md). Sinks, markup, layer value:
    ``exit_layers``; ``shared`` sinks: per chunk, 1 + the opening it shares with another chunk, capped;
    ``context_rank``: how an anchor's other context pages are ranked: ``query`` (s_l, per layer), ``keys`` (per row
    block, the anchors' own queries against per-page key bounds) or ``oracle`` (true attention mass);
    ``stale_shift*``: ``stale_shift``."""

    chunk_sink_tokens: int = 4
    chunk_sink_rule: str = "fixed"
    chunk_sink_share: float = 1.0
    chunk_sink_order: str = "offset"
    markup_share: float = 0.0
    layer_value: str = "ramp"
    context_rank: str = "query"
    own_chunk_in_budget: bool = False
    stale_shift: str = "kv"
    stale_shift_scale: float = 0.5
    stale_shift_group: str = "request"
    stale_shift_prior: float = 2.0

    def __post_init__(self) -> None:
        check_unit("chunk_sink_share", self.chunk_sink_share)
        check_unit("markup_share", self.markup_share)
        check_unit("stale_shift_scale", self.stale_shift_scale)
        check_choice("chunk_sink_rule", self.chunk_sink_rule, CHUNK_SINK_RULES)
        check_choice("chunk_sink_order", self.chunk_sink_order, SINK_ORDERS)
        check_choice("layer_value", self.layer_value, LAYER_VALUES)
        check_choice("context_rank", self.context_rank, CONTEXT_RANKS)
        check_choice("stale_shift", self.stale_shift, STALE_SHIFTS)
        check_choice("stale_shift_group", self.stale_shift_group, STALE_SHIFT_GROUPS)
        if self.stale_shift_prior < 0:
            raise ValueError(f"stale_shift_prior must be >= 0, got {self.stale_shift_prior}")


def exit_layer_sets(x: AnchorInputs) -> "list[torch.Tensor]":
    from relaxkv_sglang.repair.exit_layers import exits_to_anchor_sets, relaxkv_exit_layers

    o = x.options or RelaxKVOptions()
    exits = relaxkv_exit_layers(x.scores, x.chunk_spans, x.anchor_ratio, x.chunk_sink_tokens, o.layer_value,
                                o.chunk_sink_share, o.chunk_sink_order, x.markup, o.markup_share)
    return exits_to_anchor_sets(exits, x.n_layers)


class StaleShiftStep:
    """The stale shift of one request: at layer l it reads S_l (the anchors of ``body``, int64 [n_body]; ``body_groups``
    int64 [n_body] or None) and adds their mean deviation to the whole body."""

    def __init__(self, schedule: ScheduleView, body: "torch.Tensor") -> None:
        from relaxkv_sglang.repair.token_sets import chunk_ids

        options = schedule.config.relaxkv
        self.mode, self.scale, self.prior = options.stale_shift, options.stale_shift_scale, options.stale_shift_prior
        self.n_groups = len(schedule.chunk_spans) if options.stale_shift_group == "chunk" else 1
        self.group_of = chunk_ids(schedule.chunk_spans, schedule.n_context).clamp(min=0) if self.n_groups > 1 else None
        self.body = body
        self.body_groups = self.group_of[body] if self.group_of is not None else None
        # The sets are nested, so S_l is the body tokens recomputed past l (no per-layer set search).
        self._body_exits = schedule.exit_layers()[body]

    @classmethod
    def of(cls, schedule: ScheduleView) -> Optional["StaleShiftStep"]:
        """The step of a schedule that shifts (None: the shift is off or nothing can be shifted)."""
        from relaxkv_sglang.repair.stale_shift import shift_body

        if schedule.config.relaxkv.stale_shift == "none":
            return None
        body = shift_body(schedule.chunk_spans, schedule.n_context, schedule.chunk_sinks)
        return cls(schedule, body) if body.numel() else None

    def shift_sets(self, layer: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """(S_l, T_l): the anchors whose deviation is averaged and the tokens shifted, sorted."""
        recomputed = self._body_exits > layer
        return self.body[recomputed], self.body[~recomputed]

    def reads(self, layer: int) -> Optional[LayerRead]:
        """S_l, with each source's group (None when no anchor of the body is recomputed)."""
        sources = self.body[self._body_exits > layer]
        if sources.numel() == 0:
            return None
        return LayerRead(sources, self.group_of[sources] if self.group_of is not None else None)

    def run(self, layer: int, kv: MeasuredKV) -> LayerEdit:
        from relaxkv_sglang.repair.stale_shift import shift_deltas

        dk, dv = shift_deltas(self.mode, kv.positions, kv.k_new, kv.v_new, kv.k_stale, kv.v_stale, kv.rotate,
                              self.scale, kv.groups, self.n_groups, self.prior)
        return LayerEdit(body_dk=dk if self.mode == "kv" else None, body_dv=dv)


_OPTIONS = OptionGroup("relaxkv", RelaxKVOptions)


def _relaxkv(name: str, summary: str, role: str, context: str) -> PolicySpec:
    return PolicySpec(name, summary, role, exit_layer_sets, needs_query_scores=True, context=context,
                      options=_OPTIONS, layer_step=StaleShiftStep.of)


SPECS = (
    _relaxkv("relaxkv", "per-layer nested targets from s_l, relaxed (query-relevant) context", "method", "topk"),
    _relaxkv("relaxkv_fullctx", "relaxkv targets, full causal context", "ablation", "full"),
    _relaxkv("relaxkv_randctx", "relaxkv targets, random context of the same budget", "ablation", "random"),
)
