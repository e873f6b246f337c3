"""What a repair is asked to do and what it costs: :class:`RepairConfig`, :class:`RepairCost`, the budget split.

Joint budget (``RepairConfig.budget``): a fraction of the cost of recomputing every eligible token at every layer
with its full causal context, ``sum_l sum_{t in A_l} (1 + pair_cost * |R_l(t)|)`` token-layers. :func:`split_budget`
estimates it as if the anchors were a uniform sample of the eligible tokens, so the achieved cost is near it."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from relaxkv_sglang.model.model_family import mlp_width
from relaxkv_sglang.repair.policies import OPTION_GROUPS, Policy, PolicySpec, policy_spec
from relaxkv_sglang.repair.token_sets import chunk_offsets, eligible_tokens

Span = tuple[int, int]

__all__ = ["RepairConfig", "knob_defaults", "RepairCost", "ATTENTION_OVERHEAD", "split_budget"]


@dataclasses.dataclass(frozen=True)
class RepairConfig:
    """The knobs of a repair, for the server and the torch reference alike: those every repair policy shares, then one
    options object per option group (``config.relaxkv``). ``anchor_ratio``: mean over layers of |A_l| / n_eligible;
    ``context_ratio``: a share of each anchor's causal prefix in pages (contexts ``topk``, ``random``); ``page_size``
    in tokens; ``sink_tokens``: the first prompt tokens every anchor attends to."""

    anchor_ratio: float = 0.15
    context_ratio: float = 0.5
    page_size: int = 16
    sink_tokens: int = 4
    seed: int = 0
    budget: Optional[float] = None
    options: tuple[Any, ...] = tuple(group.type() for group in OPTION_GROUPS)

    def __post_init__(self) -> None:
        if [type(o) for o in self.options] != [group.type for group in OPTION_GROUPS]:
            raise TypeError(f"options must be one of each of {', '.join(g.type.__name__ for g in OPTION_GROUPS)}")
        for name in ("anchor_ratio", "context_ratio", "budget"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    def __getattr__(self, name: str) -> Any:
        """A policy's options by its group's name (``config.relaxkv``)."""
        index = _GROUP_INDEX.get(name)
        if index is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.options[index]

    def with_options(self, **groups: Any) -> "RepairConfig":
        unknown = set(groups) - set(_GROUP_INDEX)
        if unknown:
            raise TypeError(f"unknown option group {sorted(unknown)[0]!r}; groups: {', '.join(_GROUP_INDEX)}")
        options = tuple(groups.get(group.name, current) for group, current in zip(OPTION_GROUPS, self.options))
        return dataclasses.replace(self, options=options)

    @classmethod
    def from_knobs(cls, **knobs: Any) -> "RepairConfig":
        """A config from flat knob names (:func:`knob_defaults`), each routed to its owner (TypeError if unknown)."""
        owned: dict[str, dict[str, Any]] = {group.name: {} for group in OPTION_GROUPS}
        shared = {}
        for name, value in knobs.items():
            owner, attr = _KNOB_OWNERS.get(name, (None, name))
            if owner is None and name not in _SHARED_KNOBS:
                raise TypeError(f"unknown repair knob {name!r}; knobs: {', '.join(knob_defaults())}")
            (owned[owner] if owner else shared)[attr] = value
        options = tuple(group.type(**owned[group.name]) for group in OPTION_GROUPS)
        return cls(**shared, options=options)

    def options_of(self, policy: Policy | str | PolicySpec) -> Optional[Any]:
        group = policy_spec(policy).options
        return getattr(self, group.name) if group else None


_GROUP_INDEX = {group.name: i for i, group in enumerate(OPTION_GROUPS)}
_SHARED_KNOBS = tuple(f.name for f in dataclasses.fields(RepairConfig) if f.name != "options")
# Flat knob name -> (option group, attribute), as each group declares them.
_KNOB_OWNERS = {flat: (group.name, attr) for group in OPTION_GROUPS for flat, attr in group.flat_knobs().items()}


def knob_defaults() -> dict[str, Any]:
    """Every repair knob by its flat name (:meth:`RepairConfig.from_knobs`) with its default."""
    config = RepairConfig()
    shared = {name: getattr(config, name) for name in _SHARED_KNOBS}
    return {**shared, **{name: getattr(getattr(config, owner), attr) for name, (owner, attr) in _KNOB_OWNERS.items()}}


# An attention pair's measured cost over its multiply-add share (GPU: not measured, 1.0):
# docs/experiments/INDEX.md#attention-overhead.
ATTENTION_OVERHEAD = {"cpu": 3.0}


@dataclasses.dataclass(frozen=True)
class RepairCost:
    """Work in token-layers (one token's QKV, output and MLP projections at one layer); an attention pair costs
    ``pair_cost``: their multiply-adds' ratio (SmolLM2-135M: 3.3e-4) times :data:`ATTENTION_OVERHEAD`."""

    pair_cost: float

    @classmethod
    def from_dims(cls, hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, head_dim: int,
                  device_type: Optional[str] = None) -> "RepairCost":
        """From a Llama-style layer's dimensions and the device type (None: multiply-adds only)."""
        linear = hidden * (2 * n_heads * head_dim + 2 * n_kv_heads * head_dim) + 3 * hidden * intermediate
        attention = 2 * n_heads * head_dim  # q.k and p.v per pair
        return cls(attention / linear * ATTENTION_OVERHEAD.get(device_type, 1.0))

    @classmethod
    def from_hf_config(cls, config: dict, device_type: Optional[str] = None) -> "RepairCost":
        hidden, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls.from_dims(hidden, mlp_width(config), n_heads,
                             int(config.get("num_key_value_heads") or n_heads),
                             int(config.get("head_dim") or hidden // n_heads), device_type)

    def token_layer(self, keys: torch.Tensor) -> torch.Tensor:
        """Cost of recomputing a token at one layer with ``keys`` keys (float [...] -> float [...])."""
        return 1.0 + self.pair_cost * keys


def split_budget(budget: float, policy: Policy | PolicySpec, chunk_spans: Sequence[Span], n_context: int,
                 config: RepairConfig, cost: RepairCost) -> tuple[float, float]:
    """``(anchor_ratio, context_ratio)`` that spend ``budget`` (module doc): all on anchors for a full context;
    else on anchors at ``config.context_ratio`` first, then on context."""
    elig = eligible_tokens(chunk_spans, n_context)
    if elig.numel() == 0 or policy_spec(policy).context == "full":
        return budget, 1.0
    offset, _ = chunk_offsets(chunk_spans, elig, n_context)
    t, own = elig.double(), offset.double() + 1  # own: the token's chunk up to it
    before, sink = t + 1 - own, float(min(config.sink_tokens, n_context))

    def per_anchor(context_ratio: float) -> float:
        """Mean cost of an anchor-layer: its relaxed context as layout.py budgets it, page rounding left out."""
        if config.relaxkv.own_chunk_in_budget:
            keys = torch.clamp(context_ratio * (t + 1), min=own + sink)
        else:
            keys = own + torch.clamp(context_ratio * before, min=sink)
        return float(cost.token_layer(torch.minimum(keys, t + 1)).mean())

    target = float(cost.token_layer(t + 1).mean()) * budget  # mean cost per eligible token-layer
    c = config.context_ratio
    at_c = per_anchor(c)
    if target <= at_c:
        return target / at_c, c
    lo, hi = c, 1.0  # every token an anchor: widen the context (cost is monotone in it)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if per_anchor(mid) < target else (lo, mid)
    return 1.0, hi
