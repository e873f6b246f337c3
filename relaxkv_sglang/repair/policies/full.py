"""``full``: ordinary causal prefill of the whole prompt, no reuse at all (the quality reference)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaxkv_sglang.repair.policies.base import AnchorInputs, PolicySpec, same_every_layer

if TYPE_CHECKING:
    import torch


def every_eligible(x: AnchorInputs) -> "list[torch.Tensor]":
    """Every eligible token at every layer (also ``prefix``'s)."""
    return same_every_layer(x.eligible, x.n_layers)


SPEC = PolicySpec("full", "ordinary causal prefill, no reuse at all", "baseline", every_eligible,
                  reuses_chunks=False, repairs=False)
