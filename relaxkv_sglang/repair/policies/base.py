"""What a policy is: a :class:`PolicySpec` (declarations, an anchor rule, optional options and an
optional :class:`LayerStep` inside the forward), and the objects those exchange with the planner
and the executors.

A policy's anchor rule maps an :class:`AnchorInputs` to nested sets ``A_0 ⊇ A_1 ⊇ ...`` (a token
recomputed at layer ``l`` needs its input hidden state, which exists only if it was recomputed
at layer ``l-1``). A policy that decides or corrects something during the forward gives a
``layer_step`` factory: the planner makes one step per request from its schedule, seen as a
:class:`ScheduleView`, and each executor (the torch reference, the server's layer loop) calls it
at the layers it reads, between the layer's QKV projection and its K/V writes:

1. ``reads(l)``, on the host when the pass is planned: the anchors of layer ``l`` whose recomputed
   and cached K/V it needs (a subset of ``A_l``: only anchors hold both), or None;
2. ``run(l, MeasuredKV)``, in the forward: a :class:`LayerEdit`, the later layers' anchor sets
   decided anew (CacheBlend's check layer) and/or a K/V delta added to the stale K/V of the step's
   ``body`` tokens (the stale shift), before the layer's rows are written.

The registry is read by the torch-free client and HTTP schema, so this module and the policy
modules import torch only inside the functions that run a request.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from relaxkv_sglang.model.tensor_parallel import TensorParallel

Span = tuple[int, int]

__all__ = ["CONTEXTS", "ROLES", "check_choice", "check_unit", "OptionGroup", "AnchorInputs", "AnchorRule", "LayerRead",
           "MeasuredKV", "LayerEdit", "LayerStep", "ScheduleView", "PolicySpec", "same_every_layer", "top_tokens"]

# The anchors' context (layout.build_relaxed_layouts' modes): the whole causal prefix, the
# query-relevant pages (relaxed), or random pages of the same budget.
CONTEXTS = ("full", "topk", "random")
ROLES = ("baseline", "peer", "method", "ablation", "control")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_unit(name: str, value: float) -> None:
    """ValueError naming ``name`` unless ``value`` is in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """A policy's own knobs: a frozen dataclass held by ``RepairConfig`` under ``name``.

    Attributes:
        name: the attribute of ``RepairConfig`` it is read through (``config.relaxkv``).
        type: the frozen dataclass (plain data, validated in its ``__post_init__``).
        knobs: (flat knob name, its field) pairs (``RepairConfig.from_knobs``, a calibration's);
            None: every field under its own name.
    """

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
    """What an anchor rule reads, checked once by ``selection.select_anchors``.

    Attributes:
        scores: float [n_layers, n_context] s_l, or None (only rules whose policy needs them read it).
        chunk_spans: the chunks, sorted, inside ``[0, n_context)``.
        n_context: context tokens.
        n_layers: sets to return.
        anchor_ratio: r in [0, 1].
        eligible: int64 [n_eligible] sorted repairable tokens (``token_sets.eligible_tokens``).
        per_layer: round(r * n_eligible), the anchors of a rule with the same set at every layer.
        rng: the random control's generator.
        options: the policy's own options object (``PolicySpec.options``), or None.
        chunk_sink_tokens: int or int64 [n_chunks], each chunk's sink tokens (the planner's).
        markup: bool [n_context] the template markup every chunk repeats, or None.
    """

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
    """What a step measures at one layer (host tensors, decided when the pass is planned).

    Attributes:
        positions: int64 [n] sorted anchors of the layer (a subset of ``A_l``).
        groups: int64 [n] a tag per position handed back in :class:`MeasuredKV` (the stale
            shift's groups), or None.
    """

    positions: "torch.Tensor"
    groups: Optional["torch.Tensor"] = None


#: rotate(k [n or 1, Hkv, d], delta int64 [n]) -> k rotated by delta positions (RoPE composes).
Rotate = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclasses.dataclass(frozen=True)
class MeasuredKV:
    """The K/V a :class:`LayerRead` asked for, on the executor's device, rows in its order.

    Attributes:
        positions: int64 [n] the read's positions; groups: int64 [n] its tags (or None).
        k_new, v_new: [n, Hkv, d] their K (post-RoPE) and V recomputed at the layer.
        k_stale, v_stale: [n, Hkv, d] their cached K/V (re-rotated), as the layer holds them.
        rotate: RoPE re-rotation of post-RoPE keys by per-token position deltas.
        ranks: the tensor-parallel group whose ranks each hold some of the KV heads (None: one rank, every
            head here); a measure over heads sums its per-rank parts over it.
    """

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
    """What a step changes (module doc).

    Attributes:
        later_sets: the anchor sets of layers ``l + 1 ..`` (nested within ``A_l``), or None.
        body_dk: float32 [n_groups, Hkv, d] added to every ``body`` token's K, before RoPE (the
            executor rotates it to each token's position), or None.
        body_dv: float32 [n_groups, Hkv, d] added to every ``body`` token's V, or None.
    """

    later_sets: Optional[list["torch.Tensor"]] = None
    body_dk: Optional["torch.Tensor"] = None
    body_dv: Optional["torch.Tensor"] = None


class LayerStep(Protocol):
    """A policy's work inside the forward for one request (module doc).

    Attributes:
        body: int64 host [n_body] sorted tokens a :class:`LayerEdit`'s delta lands on, or None.
        body_groups: int64 host [n_body] each body token's row of the delta, or None (row 0).
    """

    body: Optional["torch.Tensor"]
    body_groups: Optional["torch.Tensor"]

    def reads(self, layer: int) -> Optional[LayerRead]:
        """What the step measures at ``layer`` (None: it does nothing there)."""

    def run(self, layer: int, kv: MeasuredKV) -> LayerEdit:
        """The step at ``layer``, from what :meth:`reads` asked for."""


class ScheduleView(Protocol):
    """One request's schedule as a step reads it (the planner's ``AnchorSchedule``, read-only).

    Attributes:
        config: the request's ``RepairConfig``; a step reads its own option group (``config.relaxkv``).
        n_layers: layers of the model; n_context: context tokens.
        chunk_spans: the reused chunks, sorted.
        chunk_sinks: int64 [n_chunks] each chunk's sink tokens.
        anchor_sets: per decided layer, int64 sorted anchors (nested).
        decided_layers: ``len(anchor_sets)``, below ``n_layers`` while a mid-forward step has yet to decide.
    """

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
    """What one policy does, declared.

    Attributes:
        name: the string clients send (``relaxkv_policy``).
        summary: one line, what it computes.
        role: one of :data:`ROLES`.
        anchor_rule: its targets (:data:`AnchorRule`).
        served: the server accepts it.
        reuses_chunks: chunk KV comes from the position-independent chunk tree.
        repairs: reused chunk tokens are selectively recomputed (anchors).
        needs_query_scores: its targets (or context) come from the query pass's s_l.
        context: the anchors' context, one of :data:`CONTEXTS`.
        options: its own knobs, or None.
        layer_step: :class:`ScheduleView` -> its :class:`LayerStep` for that request (None: no step there),
            or None.
        decides_mid_forward: its step decides later layers' anchors (the rule plans only the
            layers before).
    """

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
    """The sorted ``tokens`` as the set of every layer."""
    import torch

    tokens = torch.sort(tokens).values
    return [tokens.clone() for _ in range(n_layers)]


def top_tokens(values: "torch.Tensor", candidates: "torch.Tensor", k: int) -> "torch.Tensor":
    """The ``k`` candidates with the highest ``values`` (float [n_context]); ties prefer the
    earlier token (a stable sort: deterministic)."""
    import torch

    order = torch.sort(values[candidates], descending=True, stable=True).indices
    return candidates[order[:k]]
