"""``prophetkv`` (ProphetKV): the tokens the query attends to most over layers, at every layer, full context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaxkv_sglang.repair.policies.base import AnchorInputs, PolicySpec, same_every_layer, top_tokens

if TYPE_CHECKING:
    import torch


def mean_query_score(x: AnchorInputs) -> "list[torch.Tensor]":
    """The top tokens by the query's attention averaged over layers, every layer."""
    return same_every_layer(top_tokens(x.scores.float().mean(dim=0), x.eligible, x.per_layer), x.n_layers)


SPEC = PolicySpec("prophetkv", "top-r by layer-averaged query attention, every layer, full context", "peer",
                  mean_query_score, needs_query_scores=True)
