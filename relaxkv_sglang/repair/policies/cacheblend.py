"""``cacheblend`` (CacheBlend): every eligible token recomputed at layers ``0..check_layer``; the K/V deviation measured
there picks the top-r tokens of every later layer (full causal context), in the forward (:class:`CheckLayerStep`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from relaxkv_sglang.repair.policies.base import (AnchorInputs, LayerEdit, LayerRead, MeasuredKV, OptionGroup,
                                                 PolicySpec, ScheduleView, top_tokens)

if TYPE_CHECKING:
    from relaxkv_sglang.model.tensor_parallel import TensorParallel

__all__ = ["CacheBlendOptions", "kv_deviation", "check_layer_deviation", "CheckLayerStep", "SPEC"]


@dataclasses.dataclass(frozen=True)
class CacheBlendOptions:
    """CacheBlend's own knobs: layers ``0..check_layer`` recompute every eligible token, and the deviation measured
    at ``check_layer`` chooses the later layers' tokens; ``use_k``: it also counts K (else V only)."""

    check_layer: int = 1
    use_k: bool = False

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")


def kv_deviation(k_new: "torch.Tensor", v_new: "torch.Tensor", k_old: "torch.Tensor", v_old: "torch.Tensor",
                 use_k: bool = False, ranks: Optional["TensorParallel"] = None) -> "torch.Tensor":
    """float32 [n]: ||v_new - v_old||_2 over heads and dims (+ the same for K with ``use_k``), the same on every
    rank. K/V [n, n_kv_heads, d] float (K post-RoPE, same positions), this rank's heads; with ``ranks`` (the
    tensor-parallel group) each rank's sums of squares are summed over it (one collective), then rooted."""
    if ranks is None or ranks.size == 1:
        dev = (v_new.float() - v_old.float()).flatten(1).norm(dim=1)
        if use_k:
            dev = dev + (k_new.float() - k_old.float()).flatten(1).norm(dim=1)
        return dev
    import torch

    pairs = [(v_new, v_old)] + ([(k_new, k_old)] if use_k else [])
    squares = ranks.sum(torch.stack([(new.float() - old.float()).flatten(1).square().sum(dim=1) for new, old in pairs]))
    return squares.sqrt().sum(dim=0)


def check_layer_deviation(x: AnchorInputs, deviation: Optional["torch.Tensor"] = None) -> "list[torch.Tensor]":
    """Every eligible token at layers 0..check_layer; with the ``deviation`` (float [n_context], or [n_eligible])
    measured there, the top tokens by it at the later layers."""
    import torch

    check_layer = (x.options or CacheBlendOptions()).check_layer
    n_full = min(check_layer + 1, x.n_layers)
    sets = [x.eligible.clone() for _ in range(n_full)]
    if deviation is None:
        return sets
    dev = deviation.float()
    n_elig = x.eligible.numel()
    if dev.numel() == n_elig and n_elig != x.n_context:
        full = torch.zeros(x.n_context)
        full[x.eligible] = dev
        dev = full
    chosen = torch.sort(top_tokens(dev, x.eligible, x.per_layer)).values
    return sets + [chosen.clone() for _ in range(x.n_layers - n_full)]


class CheckLayerStep:
    """At the check layer, the deviation of every recomputed token decides the later layers."""

    body = None
    body_groups = None

    def __init__(self, schedule: ScheduleView) -> None:
        self.schedule = schedule
        self.check_layer = schedule.config.cacheblend.check_layer

    @classmethod
    def of(cls, schedule: ScheduleView) -> Optional["CheckLayerStep"]:
        """The step of a schedule whose later layers are still undecided."""
        return cls(schedule) if schedule.decided_layers < schedule.n_layers else None

    def reads(self, layer: int) -> Optional[LayerRead]:
        """The check layer's anchors (every eligible token)."""
        return LayerRead(self.schedule.anchor_sets[layer]) if layer == self.check_layer else None

    def run(self, layer: int, kv: MeasuredKV) -> LayerEdit:
        """Later layers' sets from the deviation, read back (once per request) to the host, where plans live."""
        import torch

        schedule = self.schedule
        deviation = torch.zeros(schedule.n_context)
        deviation[kv.positions.cpu()] = kv_deviation(kv.k_new, kv.v_new, kv.k_stale, kv.v_stale,
                                                     schedule.config.cacheblend.use_k, kv.ranks).cpu()
        sets = check_layer_deviation(schedule.anchor_inputs(), deviation)
        return LayerEdit(later_sets=sets[layer + 1:])


SPEC = PolicySpec("cacheblend", "all tokens up to a check layer, then top-r by K/V deviation, full context", "peer",
                  check_layer_deviation,
                  options=OptionGroup("cacheblend", CacheBlendOptions,
                                      (("check_layer", "check_layer"), ("cacheblend_use_k", "use_k"))),
                  layer_step=CheckLayerStep.of, decides_mid_forward=True)
