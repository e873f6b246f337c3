"""The policy registry: every way a request can be prefilled, one :class:`PolicySpec` each.

A policy is a declaration, not a branch: :data:`POLICY_SPECS` holds one frozen spec per
:class:`Policy` (what it reuses, whether it repairs, what it needs from the forward, its anchor
rule in :data:`relaxkv_sglang.core.selection.ANCHOR_RULES`, its anchors' context, whether the stale
shift applies, its options object). The server, the benchmarks and the tests read this table, so
adding a policy is one spec here (plus one rule in ``selection.py`` if it selects anchors anew).

Checked against the registry by ``tests/unit/test_selection.py``:

==================  ========  =============  =======  ============  =============  ========  ========
policy              served    reuses chunks  repairs  query scores  K/V deviation  context   role
==================  ========  =============  =======  ============  =============  ========  ========
full                yes       no             no       no            no             (causal)  baseline
prefix              yes       no             no       no            no             (causal)  baseline
pic                 yes       yes            no       no            no             (none)    baseline
epic                yes       yes            yes      no            no             full      peer
cacheblend          yes       yes            yes      no            yes            full      peer
prophetkv           yes       yes            yes      yes           no             full      peer
relaxkv             yes       yes            yes      yes           no             topk      method
relaxkv_fullctx     yes       yes            yes      yes           no             full      ablation
relaxkv_randctx     yes       yes            yes      yes           no             random    ablation
random              no        yes            yes      no            no             full      control
==================  ========  =============  =======  ============  =============  ========  ========

``prefix`` is SGLang's radix cache; ``random`` runs in the torch reference only. Knobs every
repair shares are in ``repair_config.RepairConfig``; a policy's own are in its options object
(:class:`RelaxKVOptions`, :class:`CacheBlendOptions`; plain data, no torch).
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Mapping, Optional

__all__ = ["Policy", "PolicySpec", "POLICY_SPECS", "policy_spec", "served_policies", "chunk_policies",
           "repair_policies", "RelaxKVOptions", "CacheBlendOptions", "SERVER_POLICIES", "CHUNK_POLICIES",
           "REPAIR_POLICIES", "DEFAULT_POLICY", "CONTEXTS", "ROLES", "LAYER_VALUES", "SINK_ORDERS",
           "CHUNK_SINK_RULES", "CONTEXT_RANKS", "STALE_SHIFTS",
           "STALE_SHIFT_GROUPS"]


class Policy(str, enum.Enum):
    """A policy's name: the string clients send (``relaxkv_policy``); its spec says what it does."""

    FULL = "full"
    PREFIX = "prefix"
    PIC = "pic"
    EPIC = "epic"
    CACHEBLEND = "cacheblend"
    PROPHETKV = "prophetkv"
    RELAXKV = "relaxkv"
    RELAXKV_FULLCTX = "relaxkv_fullctx"
    RELAXKV_RANDCTX = "relaxkv_randctx"
    RANDOM = "random"

    @property
    def spec(self) -> "PolicySpec":
        """Its entry in :data:`POLICY_SPECS`."""
        return POLICY_SPECS[self]

    @property
    def served(self) -> bool:
        """Whether the server accepts it as a request's policy."""
        return self.spec.served

    @property
    def reuses_chunks(self) -> bool:
        """Chunk KV comes from the position-independent chunk tree."""
        return self.spec.reuses_chunks

    @property
    def repairs(self) -> bool:
        """Reused chunk tokens are selectively recomputed (anchors)."""
        return self.spec.repairs

    @property
    def needs_query_scores(self) -> bool:
        """True when targets (or context) are chosen from the stale query pass s_l."""
        return self.spec.needs_query_scores

    @property
    def context_mode(self) -> str:
        """Context of the anchors: 'full' (causal prefix), 'topk' (relaxed) or 'random'."""
        return self.spec.context


# The anchors' context (layout.build_relaxed_layouts' modes): the whole causal prefix, the
# query-relevant pages (relaxed), or random pages of the same budget.
CONTEXTS = ("full", "topk", "random")
ROLES = ("baseline", "peer", "method", "ablation", "control")

# Values of the relaxkv knobs (RelaxKVOptions); declared here, beside their options, so the
# options validate without torch. The rules themselves are in exit_layers.py, layout.py and
# stale_shift.py.
LAYER_VALUES = ("uniform", "skip0", "depth", "ramp")
SINK_ORDERS = ("offset", "score")
CHUNK_SINK_RULES = ("fixed", "shared")
CONTEXT_RANKS = ("query", "keys", "oracle")
STALE_SHIFTS = ("none", "v", "kv")
STALE_SHIFT_GROUPS = ("request", "chunk")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class RelaxKVOptions:
    """The relaxkv policies' own knobs (relaxkv and its two ablations). Why each default:
    docs/experiments/INDEX.md (tuned with ``scripts/ablate_repair.py``).

    Attributes:
        chunk_sink_tokens: first tokens of each chunk favoured as targets (with
            ``chunk_sink_rule="shared"``, the most per chunk; ``exit_layers`` module doc).
        chunk_sink_rule: ``fixed`` (every chunk ``chunk_sink_tokens``) or ``shared`` (per chunk,
            1 + the opening it shares with another chunk of the request, capped at
            ``chunk_sink_tokens``: ``token_sets.shared_opening_sinks``; an ablation).
        chunk_sink_share: the largest share of the budget those sinks take first (an ablation below 1).
        chunk_sink_order: which sinks first when they do not all fit (``offset`` or ``score``, an
            ablation; ``exit_layers.relaxkv_exit_layers``).
        markup_share: the largest share of the budget the template markup every chunk repeats
            (``token_sets.shared_runs``) takes at every layer, after the chunk sinks; 0: off
            (``exit_layers`` module doc); an ablation.
        layer_value: how correcting a token at each layer is valued (``exit_layers.layer_weights``:
            uniform, skip0, depth, ramp).
        context_rank: how the other pages of an anchor's context are ranked: ``query`` (the query's
            attention s_l, one ranking per layer), ``keys`` (per row block, the anchors' own queries
            against per-page key bounds, ``layout.key_bound_page_scores``, decided in the layer) or
            ``oracle`` (their true attention mass, dense: an ablation only).
        own_chunk_in_budget: whether the relaxed context budget counts the anchor's own chunk
            (``layout.build_relaxed_layout``).
        stale_shift: how the non-anchors' stale K/V are corrected at each layer (``stale_shift.py``):
            ``none``, ``v`` (V shifted by the layer's anchors' mean deviation) or ``kv`` (K too,
            compared before RoPE).
        stale_shift_scale: the fraction of that mean deviation added, in [0, 1].
        stale_shift_group: whose anchors a token's shift is the mean deviation of: ``request``
            (every anchor of the layer, one shift for the request) or ``chunk`` (its own chunk's
            anchors, shrunk toward the request's mean: ``stale_shift.group_means``).
        stale_shift_prior: with ``chunk``, the weight of the request's mean in each chunk's, in
            anchors (0: the chunk's anchors alone; a chunk without anchors takes the request's).
    """

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
        _check_unit("chunk_sink_share", self.chunk_sink_share)
        _check_unit("markup_share", self.markup_share)
        _check_unit("stale_shift_scale", self.stale_shift_scale)
        _check_choice("chunk_sink_rule", self.chunk_sink_rule, CHUNK_SINK_RULES)
        _check_choice("chunk_sink_order", self.chunk_sink_order, SINK_ORDERS)
        _check_choice("layer_value", self.layer_value, LAYER_VALUES)
        _check_choice("context_rank", self.context_rank, CONTEXT_RANKS)
        _check_choice("stale_shift", self.stale_shift, STALE_SHIFTS)
        _check_choice("stale_shift_group", self.stale_shift_group, STALE_SHIFT_GROUPS)
        if self.stale_shift_prior < 0:
            raise ValueError(f"stale_shift_prior must be >= 0, got {self.stale_shift_prior}")


@dataclasses.dataclass(frozen=True)
class CacheBlendOptions:
    """CacheBlend's own knobs.

    Attributes:
        check_layer: layers ``0..check_layer`` recompute every eligible token; the deviation measured
            at ``check_layer`` chooses the later layers' tokens.
        use_k: the deviation also counts K (else V only).
    """

    check_layer: int = 1
    use_k: bool = False

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer must be >= 0, got {self.check_layer}")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What one policy does, declared.

    Attributes:
        policy: its name.
        summary: one line, what it computes.
        role: one of :data:`ROLES`.
        served: the server accepts it.
        reuses_chunks: chunk KV comes from the position-independent chunk tree.
        repairs: reused chunk tokens are selectively recomputed (anchors).
        needs_query_scores: its targets (or context) come from the query pass's s_l.
        needs_kv_deviation: its later layers' targets come from the K/V deviation measured at a
            check layer, so they are decided in the forward (``AnchorPlan.after_check_layer``).
        anchor_rule: the name of its rule in ``selection.ANCHOR_RULES``.
        context: the anchors' context, one of :data:`CONTEXTS`.
        stale_shift: ``RelaxKVOptions.stale_shift`` applies (the peers run as published).
        options: the ``RepairConfig`` field holding its own knobs, or None.
    """

    policy: Policy
    summary: str
    role: str
    anchor_rule: str
    served: bool = True
    reuses_chunks: bool = True
    repairs: bool = True
    needs_query_scores: bool = False
    needs_kv_deviation: bool = False
    context: str = "full"
    stale_shift: bool = False
    options: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("context", self.context, CONTEXTS)
        _check_choice("role", self.role, ROLES)
        if self.repairs and not self.reuses_chunks:
            raise ValueError(f"{self.policy.value}: a policy that repairs reuses chunks")

    @property
    def decides_mid_forward(self) -> bool:
        """Some layers' targets are decided during the forward (CacheBlend's check layer)."""
        return self.needs_kv_deviation


def _relaxkv(policy: Policy, summary: str, role: str, context: str) -> PolicySpec:
    """RelaxKV and its ablations share targets, knobs and the stale shift; they differ in context."""
    return PolicySpec(policy, summary, role, "exit_layers", needs_query_scores=True, context=context,
                      stale_shift=True, options="relaxkv")


POLICY_SPECS: Mapping[Policy, PolicySpec] = types.MappingProxyType({spec.policy: spec for spec in (
    PolicySpec(Policy.FULL, "ordinary causal prefill, no reuse at all", "baseline", "every_eligible",
               reuses_chunks=False, repairs=False),
    PolicySpec(Policy.PREFIX, "SGLang's radix cache: exact prefix reuse only", "baseline", "every_eligible",
               reuses_chunks=False, repairs=False),
    PolicySpec(Policy.PIC, "chunks' independent (re-rotated) KV, no repair", "baseline", "none", repairs=False),
    PolicySpec(Policy.EPIC, "first k tokens of each chunk, every layer, full causal context", "peer",
               "chunk_openings"),
    PolicySpec(Policy.CACHEBLEND, "all tokens up to a check layer, then top-r by K/V deviation, full context",
               "peer", "check_layer_deviation", needs_kv_deviation=True, options="cacheblend"),
    PolicySpec(Policy.PROPHETKV, "top-r by layer-averaged query attention, every layer, full context", "peer",
               "mean_query_score", needs_query_scores=True),
    _relaxkv(Policy.RELAXKV, "per-layer nested targets from s_l, relaxed (query-relevant) context", "method",
             "topk"),
    _relaxkv(Policy.RELAXKV_FULLCTX, "relaxkv targets, full causal context", "ablation", "full"),
    _relaxkv(Policy.RELAXKV_RANDCTX, "relaxkv targets, random context of the same budget", "ablation", "random"),
    PolicySpec(Policy.RANDOM, "uniformly random targets, every layer, full context", "control", "uniform_random",
               served=False),
)})


def policy_spec(policy: Policy | str) -> PolicySpec:
    """The spec of ``policy`` (a Policy or its value; ValueError for an unknown name)."""
    return POLICY_SPECS[Policy(policy)]


def served_policies() -> tuple[str, ...]:
    """The values the server accepts, in registry order."""
    return tuple(p.value for p, s in POLICY_SPECS.items() if s.served)


def chunk_policies() -> tuple[str, ...]:
    """Served policies that reuse chunks (``pic`` and the repair policies), in registry order."""
    return tuple(p.value for p, s in POLICY_SPECS.items() if s.served and s.reuses_chunks)


def repair_policies(ablations: bool = True) -> tuple[str, ...]:
    """Served policies that repair, in registry order; without ``ablations`` only the peers and
    the method (what a benchmark compares)."""
    return tuple(p.value for p, s in POLICY_SPECS.items()
                 if s.served and s.repairs and (ablations or s.role != "ablation"))


SERVER_POLICIES: tuple[str, ...] = served_policies()
CHUNK_POLICIES: frozenset[str] = frozenset(chunk_policies())
REPAIR_POLICIES: tuple[str, ...] = repair_policies()
# What a request without a policy gets: SGLang's own behaviour, so installing the plugin
# changes nothing until a request (or RELAXKV_DEFAULT_POLICY) asks for chunk reuse.
DEFAULT_POLICY = Policy.PREFIX.value
