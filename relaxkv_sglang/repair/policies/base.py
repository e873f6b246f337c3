"""What a policy is (:class:`PolicySpec`) and what its anchor rule and :class:`LayerStep` exchange with the executors.

An anchor rule maps :class:`AnchorInputs` to nested sets ``A_0 ⊇ A_1 ⊇ ...`` (a token recomputed at ``l`` needs its
input hidden state, which exists only if it was recomputed at ``l-1``). A step runs between a layer's QKV projection
and its K/V writes: ``reads(l)``, planned on the host, names the anchors whose new and cached K/V ``run`` measures.
The torch-free client and HTTP schema read the registry: torch is imported only where a request runs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from relaxkv_sglang.model.tensor_parallel import TensorParallel

Span = tuple[int, int]

__all__ = ["CONTEXTS", "ROLES", "check_choice", "check_unit", "OptionGroup", "AnchorInputs", "AnchorRule", "LayerRead",
           "MeasuredKV", "LayerEdit", "LayerStep", "ScheduleView", "PolicySpec", "same_every_layer", "top_tokens"]

# The anchors' context: the whole causal prefix, query-relevant pages (relaxed), or random pages of the same budget.
CONTEXTS = ("full", "topk", "random")
ROLES = ("baseline", "peer", "method", "ablation", "control")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """A policy's own knobs: a frozen dataclass ``type`` held by ``RepairConfig`` as ``config.<name>``; ``knobs``:
    (flat knob name, field) pairs (``RepairConfig.from_knobs``), None: every field under its own name."""

    name: str
    type: type
    knobs: Optional[tuple[tuple[str, str], ...]] = None

    def flat_knobs(self) -> dict[str, str]:
        """Flat knob name -> field of :attr:`type`."""
        if self.knobs is not None:
            return dict(self.knobs)
        return {f.name: f.name for f in dataclasses.fields(self.type)}


@dataclasses.dataclass(frozen=True)
class AnchorInputs:
    """An anchor rule's inputs: ``scores`` float [n_layers, n_context] or None; ``eligible`` int64 [n_eligible] sorted;
    ``per_layer`` round(r * n_eligible); ``chunk_sink_tokens`` int or int64 [n_chunks]; ``markup`` bool [n_context]."""

    scores: Optional["torch.Tensor"]
    chunk_spans: Sequence[Span]
    n_context: int
    n_layers: int
    anchor_ratio: float
    eligible: "torch.Tensor"
    per_layer: int
    rng: Optional["torch.Generator"] = None
    options: Any = None
    chunk_sink_tokens: "int | torch.Tensor" = 4
    markup: Optional["torch.Tensor"] = None


#: AnchorInputs -> n_layers int64 sorted sets, nested (fewer for a policy whose step decides the rest).
AnchorRule = Callable[[AnchorInputs], "list[torch.Tensor]"]


@dataclasses.dataclass(frozen=True)
class LayerRead:
    """What a step measures at one layer: ``positions`` int64 host [n] sorted anchors of the layer; ``groups`` int64
    host [n] tags handed back in :class:`MeasuredKV`, or None."""

    positions: "torch.Tensor"
    groups: Optional["torch.Tensor"] = None


#: rotate(k [n or 1, Hkv, d], delta int64 [n]) -> k rotated by delta positions (RoPE composes).
Rotate = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclasses.dataclass(frozen=True)
class MeasuredKV:
    """The K/V a :class:`LayerRead` asked for, on the executor's device: ``*_new`` [n, Hkv, d] recomputed (K post-RoPE),
    ``*_stale`` [n, Hkv, d] cached; ``ranks`` the tensor-parallel group holding the KV heads (None: one rank)."""

    positions: "torch.Tensor"
    groups: Optional["torch.Tensor"]
    k_new: "torch.Tensor"
    v_new: "torch.Tensor"
    k_stale: "torch.Tensor"
    v_stale: "torch.Tensor"
    rotate: Rotate
    ranks: Optional["TensorParallel"] = None


@dataclasses.dataclass(frozen=True)
class LayerEdit:
    """What a step changes: ``later_sets`` the anchor sets of layers ``l + 1 ..``; ``body_dk`` / ``body_dv`` float32
    [n_groups, Hkv, d] added to every ``body`` token's K (before RoPE) / V."""

    later_sets: Optional[list["torch.Tensor"]] = None
    body_dk: Optional["torch.Tensor"] = None
    body_dv: Optional["torch.Tensor"] = None


class LayerStep(Protocol):
    """A policy's work inside the forward for one request: ``body`` int64 host [n_body] sorted tokens a delta lands on;
    ``body_groups`` int64 host [n_body] each one's delta row (None: 0)."""

    body: Optional["torch.Tensor"]
    body_groups: Optional["torch.Tensor"]

    def reads(self, layer: int) -> Optional[LayerRead]:
        """What the step measures at ``layer`` (None: it does nothing there)."""

    def run(self, layer: int, kv: MeasuredKV) -> LayerEdit:
        """The step at ``layer``, from what :meth:`reads` asked for."""


class ScheduleView(Protocol):
    """One request's schedule as a step reads it (the planner's ``AnchorSchedule``): ``chunk_sinks`` int64 [n_chunks];
    ``anchor_sets`` per decided layer int64 sorted (fewer than ``n_layers`` before a mid-forward step)."""

    @property
    def config(self) -> Any: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_context(self) -> int: ...
    @property
    def chunk_spans(self) -> Sequence[Span]: ...
    @property
    def chunk_sinks(self) -> "torch.Tensor": ...
    @property
    def anchor_sets(self) -> Sequence["torch.Tensor"]: ...
    @property
    def decided_layers(self) -> int: ...

    def exit_layers(self) -> "torch.Tensor":
        """int64 [n_context]: e(t), the layers ``[0, e(t))`` token t is recomputed at (0: never)."""

    def anchor_inputs(self) -> AnchorInputs:
        """What the policy's anchor rule read for this request."""


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What one policy does: ``reuses_chunks`` chunk KV from the position-independent chunk tree; ``repairs`` chunk
    tokens selectively recomputed; ``needs_query_scores`` targets (or context) from s_l; ``layer_step``:
    :class:`ScheduleView` -> :class:`LayerStep` or None; ``decides_mid_forward``: its step decides the rest."""

    name: str
    summary: str
    role: str
    anchor_rule: AnchorRule
    served: bool = True
    reuses_chunks: bool = True
    repairs: bool = True
    needs_query_scores: bool = False
    context: str = "full"
    options: Optional[OptionGroup] = None
    layer_step: Optional[Callable[[ScheduleView], Optional[LayerStep]]] = None
    decides_mid_forward: bool = False

    def __post_init__(self) -> None:
        check_choice("context", self.context, CONTEXTS)
        check_choice("role", self.role, ROLES)
        if self.repairs and not self.reuses_chunks:
            raise ValueError(f"{self.name}: a policy that repairs reuses chunks")
        if self.decides_mid_forward and self.layer_step is None:
            raise ValueError(f"{self.name}: a policy that decides mid-forward needs a layer_step")


def same_every_layer(tokens: "torch.Tensor", n_layers: int) -> "list[torch.Tensor]":
    import torch

    tokens = torch.sort(tokens).values
    return [tokens.clone() for _ in range(n_layers)]


def top_tokens(values: "torch.Tensor", candidates: "torch.Tensor", k: int) -> "torch.Tensor":
    """The ``k`` candidates with the highest ``values`` (float [n_context]); ties prefer the earlier token (stable)."""
    import torch

    order = torch.sort(values[candidates], descending=True, stable=True).indices
    return candidates[order[:k]]
