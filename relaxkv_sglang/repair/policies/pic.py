"""``pic``: the chunks' independent KV, re-rotated to their positions, nothing recomputed (naive reuse)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relaxkv_sglang.repair.policies.base import AnchorInputs, PolicySpec

if TYPE_CHECKING:
    import torch


def no_anchors(x: AnchorInputs) -> "list[torch.Tensor]":
    import torch

    return [torch.zeros(0, dtype=torch.long) for _ in range(x.n_layers)]


SPEC = PolicySpec("pic", "chunks' independent (re-rotated) KV, no repair", "baseline", no_anchors, repairs=False)
