"""Repair targets: :func:`select_anchors` checks the inputs once, builds an :class:`~.policies.base.AnchorInputs` and
calls the policy's rule (in its module of :mod:`.policies`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from relaxkv_sglang.repair.exit_layers import exits_to_anchor_sets, layer_weights, relaxkv_exit_layers
from relaxkv_sglang.repair.policies import Policy, PolicySpec, policy_spec
from relaxkv_sglang.repair.policies.base import AnchorInputs
from relaxkv_sglang.repair.token_sets import (anchor_budget, chunk_ids, chunk_offsets, eligible_tokens,
                                              shared_opening_sinks, sinks_of_tokens)

Span = tuple[int, int]

# The token-set and exit-layer names stay importable from here (callers choose anchors with them).
__all__ = [
    "eligible_tokens",
    "chunk_ids",
    "chunk_offsets",
    "shared_opening_sinks",
    "sinks_of_tokens",
    "layer_weights",
    "relaxkv_exit_layers",
    "exits_to_anchor_sets",
    "select_anchors",
    "anchor_ratio_achieved",
]


def select_anchors(
    policy: Policy | str | PolicySpec,
    scores: Optional[torch.Tensor],
    chunk_spans: Sequence[Span],
    n_context: int,
    anchor_ratio: float,
    rng: Optional[torch.Generator] = None,
    *,
    n_layers: Optional[int] = None,
    options: Optional[Any] = None,
    chunk_sink_tokens: int | torch.Tensor = 4,
    markup: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """The anchor sets of one request (its spec's ``anchor_rule``), int64 sorted, nested: one per layer, or (a policy
    that decides mid-forward) the layers up to its step. ``scores`` float [n_layers, n_context] s_l, required by
    policies that need query scores (else ``n_layers``); ``anchor_ratio`` met within one token per layer
    (CacheBlend's check layers recompute every eligible token); ``chunk_sink_tokens`` one count or int64 [n_chunks];
    ``markup`` bool [n_context]. Example (relaxkv, 25% of two 16-token chunks' token-layers, 4 layers):

    >>> scores = torch.rand(4, 40, generator=torch.Generator().manual_seed(0))
    >>> sets = select_anchors("relaxkv", scores, [(4, 20), (20, 36)], 40, 0.25)
    >>> sum(len(a) for a in sets) == round(0.25 * 4 * 32)  # the budget, met exactly
    True
    >>> all(set(b.tolist()) <= set(a.tolist()) for a, b in zip(sets, sets[1:]))  # nested
    True
    """
    spec = policy_spec(policy)
    if scores is not None:
        if scores.dim() != 2 or scores.shape[1] != n_context:
            raise ValueError(f"scores must be [n_layers, {n_context}], got {tuple(scores.shape)}")
        n_layers = scores.shape[0] if n_layers is None else n_layers
    if n_layers is None:
        raise ValueError("n_layers is required when scores is None")
    if spec.needs_query_scores and scores is None:
        raise ValueError(f"{spec.name} needs query scores")
    if options is None and spec.options is not None:
        options = spec.options.type()
    elig = eligible_tokens(chunk_spans, n_context)
    inputs = AnchorInputs(scores, chunk_spans, n_context, n_layers, anchor_ratio, elig,
                          anchor_budget(anchor_ratio, elig.numel()), rng, options, chunk_sink_tokens, markup)
    return spec.anchor_rule(inputs)


def anchor_ratio_achieved(anchor_sets: Sequence[torch.Tensor], n_eligible: int) -> float:
    """mean over layers of |A_l| / n_eligible (0.0 when nothing is eligible)."""
    if n_eligible == 0 or not anchor_sets:
        return 0.0
    return sum(int(a.numel()) for a in anchor_sets) / (len(anchor_sets) * n_eligible)
