"""``epic`` (EPIC): the first tokens of each chunk recomputed at every layer, full causal context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaxkv_sglang.repair.policies.base import AnchorInputs, PolicySpec, same_every_layer

if TYPE_CHECKING:
    import torch


def chunk_openings(x: AnchorInputs) -> "list[torch.Tensor]":
    """The first k tokens of each chunk; the last partial round goes to the earlier chunks, so
    exactly round(r * n_eligible) tokens are taken."""
    import torch

    from relaxkv_sglang.repair.token_sets import chunk_offsets

    offs, cid = chunk_offsets(x.chunk_spans, x.eligible, x.n_context)
    key = offs * (int(cid.max()) + 1 if x.eligible.numel() else 1) + cid
    return same_every_layer(x.eligible[torch.argsort(key, stable=True)[:x.per_layer]], x.n_layers)


SPEC = PolicySpec("epic", "first k tokens of each chunk, every layer, full causal context", "peer", chunk_openings)
