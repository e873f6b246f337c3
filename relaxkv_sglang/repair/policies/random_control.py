"""``random``: uniformly random targets, the control every rule must beat (torch reference only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaxkv_sglang.repair.policies.base import AnchorInputs, PolicySpec, same_every_layer

if TYPE_CHECKING:
    import torch


def uniform_random(x: AnchorInputs) -> "list[torch.Tensor]":
    """A uniform sample of the eligible tokens (from ``x.rng``), the same at every layer."""
    import torch

    perm = torch.randperm(x.eligible.numel(), generator=x.rng)
    return same_every_layer(x.eligible[perm[:x.per_layer]], x.n_layers)


SPEC = PolicySpec("random", "uniformly random targets, every layer, full context", "control", uniform_random,
                  served=False)
