"""Repair targets: query attention scores, CacheBlend's deviation, and per-layer anchor sets for
every policy (the rule its spec names).

The token vocabulary (context, chunk spans, eligible tokens, anchor ratio) is in
:mod:`.token_sets`; RelaxKV's exit-layer rule, layer values and chunk sinks in :mod:`.exit_layers`.
Every rule returns nested sets ``A_0 ⊇ A_1 ⊇ ...`` (a token recomputed at layer ``l`` needs its
input hidden state, which exists only if it was recomputed at layer ``l-1``).

Anchor rules (``ANCHOR_RULES``): each policy's spec (``policies.POLICY_SPECS``) names the rule
that chooses its targets; :func:`select_anchors` checks the inputs once, builds an
:class:`AnchorInputs` and calls that rule, so a rule is one function of one parameter object.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping, Optional, Sequence

import torch

from .exit_layers import exits_to_anchor_sets, layer_weights, relaxkv_exit_layers
from .policies import Policy, policy_spec
from .token_sets import (anchor_budget, chunk_ids, chunk_offsets, eligible_tokens, shared_opening_sinks,
                         sinks_of_tokens)

Span = tuple[int, int]

# The token-set and exit-layer names stay importable from here (callers choose anchors with them).
__all__ = [
    "query_attention_scores",
    "eligible_tokens",
    "chunk_ids",
    "chunk_offsets",
    "shared_opening_sinks",
    "sinks_of_tokens",
    "layer_weights",
    "relaxkv_exit_layers",
    "exits_to_anchor_sets",
    "kv_deviation",
    "AnchorInputs",
    "ANCHOR_RULES",
    "select_anchors",
    "anchor_ratio_achieved",
]


# ----------------------------------------------------------------------------- scores


def query_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    n_context: int,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Query attention mass per context token: ``s(t) = sum_{q, heads} softmax(q K^T)[t]``.

    Args:
        q: [n_q, n_heads, d] (or [n_layers, n_q, n_heads, d]) float; the query tokens' queries,
           post-RoPE.  Query token i sits at key index ``n_context + i``.
        k: [n_context + n_q, n_kv_heads, d] (or with a leading n_layers dim) float; the stale
           context keys followed by the query tokens' own keys, post-RoPE.
        n_context: number of context keys (columns kept in the result).
        scale: softmax scale, default ``d ** -0.5``.

    GQA: head h reads kv head ``h // (n_heads // n_kv_heads)``.  The softmax runs over all keys
    a query token can see (context + query keys up to itself, causal), so mass spent on the
    query's own tokens is not handed to the context; only context columns are returned.

    Returns:
        float32 [n_context] (or [n_layers, n_context]).
    """
    if q.dim() == 4:
        return torch.stack(
            [query_attention_scores(q[i], k[i], n_context, scale) for i in range(q.shape[0])]
        )
    n_q, n_heads, d = q.shape
    n_keys, n_kv, _ = k.shape
    if n_keys != n_context + n_q:
        raise ValueError(f"k has {n_keys} keys, expected n_context + n_q = {n_context + n_q}")
    if n_heads % n_kv:
        raise ValueError("n_heads must be a multiple of n_kv_heads")
    scale = d ** -0.5 if scale is None else scale
    group = n_heads // n_kv
    # One batched matmul per KV head over its `group` query heads: K is read as it is stored
    # (no copy per query head); head h = kv * group + j, as in the GQA rule above.
    q_grouped = q.float().reshape(n_q, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * n_q, d)
    logits = torch.bmm(q_grouped, k.float().permute(1, 2, 0)).mul_(scale).view(n_kv, group, n_q, n_keys)
    # Query i sees every context key and query keys 0..i.
    after_self = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device).triu_(1)
    logits[..., n_context:].masked_fill_(after_self, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs[..., :n_context].sum(dim=(0, 1, 2)).to(torch.float32)



# ----------------------------------------------------------------------------- cacheblend


def kv_deviation(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_old: torch.Tensor,
    v_old: torch.Tensor,
    use_k: bool = False,
) -> torch.Tensor:
    """CacheBlend's per-token deviation between recomputed and cached KV at the check layer.

    Args:
        k_new, k_old: [n, n_kv_heads, d] float (post-RoPE, same positions).
        v_new, v_old: [n, n_kv_heads, d] float.
        use_k: also add the L2 deviation of K.
    Returns:
        float32 [n]: ||v_new - v_old||_2 over heads and dims (+ the same for K).
    """
    dev = (v_new.float() - v_old.float()).flatten(1).norm(dim=1)
    if use_k:
        dev = dev + (k_new.float() - k_old.float()).flatten(1).norm(dim=1)
    return dev


# ----------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class AnchorInputs:
    """What an anchor rule reads, checked once by :func:`select_anchors`.

    Attributes:
        scores: float [n_layers, n_context] s_l, or None (only rules whose policy needs them read it).
        chunk_spans: the chunks, sorted, inside ``[0, n_context)``.
        n_context: context tokens.
        n_layers: sets to return.
        anchor_ratio: r in [0, 1].
        eligible: int64 [n_eligible] sorted repairable tokens (:func:`eligible_tokens`).
        per_layer: round(r * n_eligible), the anchors of a rule with the same set at every layer.
        rng: the random control's generator.
        deviation: float [n_context] or [n_eligible], cacheblend's K/V deviation, or None.
        check_layer: cacheblend's check layer.
        chunk_sink_tokens, layer_value, chunk_sink_share, chunk_sink_order, markup, markup_share:
            relaxkv's (:func:`relaxkv_exit_layers`).
    """

    scores: Optional[torch.Tensor]
    chunk_spans: Sequence[Span]
    n_context: int
    n_layers: int
    anchor_ratio: float
    eligible: torch.Tensor
    per_layer: int
    rng: Optional[torch.Generator] = None
    deviation: Optional[torch.Tensor] = None
    check_layer: int = 1
    chunk_sink_tokens: int | torch.Tensor = 4
    layer_value: str = "uniform"
    chunk_sink_share: float = 1.0
    chunk_sink_order: str = "offset"
    markup: Optional[torch.Tensor] = None
    markup_share: float = 0.0


def _same_every_layer(tokens: torch.Tensor, n_layers: int) -> list[torch.Tensor]:
    tokens = torch.sort(tokens).values
    return [tokens.clone() for _ in range(n_layers)]


def _top(values: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    # Stable descending sort: equal scores prefer the earlier token (deterministic).
    order = torch.sort(values[candidates], descending=True, stable=True).indices
    return candidates[order[:k]]


def _every_eligible(x: AnchorInputs) -> list[torch.Tensor]:
    """full, prefix: every eligible token is computed at every layer."""
    return _same_every_layer(x.eligible, x.n_layers)


def _no_anchors(x: AnchorInputs) -> list[torch.Tensor]:
    """pic: nothing is recomputed."""
    return [torch.zeros(0, dtype=torch.long) for _ in range(x.n_layers)]


def _chunk_openings(x: AnchorInputs) -> list[torch.Tensor]:
    """epic: the first k tokens of each chunk; the last partial round goes to the earlier chunks,
    so exactly round(r * n_eligible) tokens are taken."""
    offs, cid = chunk_offsets(x.chunk_spans, x.eligible, x.n_context)
    key = offs * (int(cid.max()) + 1 if x.eligible.numel() else 1) + cid
    return _same_every_layer(x.eligible[torch.argsort(key, stable=True)[:x.per_layer]], x.n_layers)


def _uniform_random(x: AnchorInputs) -> list[torch.Tensor]:
    """random: a uniform sample of the eligible tokens, the same at every layer."""
    perm = torch.randperm(x.eligible.numel(), generator=x.rng)
    return _same_every_layer(x.eligible[perm[:x.per_layer]], x.n_layers)


def _mean_query_score(x: AnchorInputs) -> list[torch.Tensor]:
    """prophetkv: the top tokens by the query's attention averaged over layers, every layer."""
    return _same_every_layer(_top(x.scores.float().mean(dim=0), x.eligible, x.per_layer), x.n_layers)


def _check_layer_deviation(x: AnchorInputs) -> list[torch.Tensor]:
    """cacheblend: every eligible token at layers 0..check_layer; with the deviation measured there,
    the top tokens by it at the later layers (without it, only the check layers: the executor
    calls again once it has measured)."""
    n_full = min(x.check_layer + 1, x.n_layers)
    sets = [x.eligible.clone() for _ in range(n_full)]
    if x.deviation is None:
        return sets
    dev = x.deviation.float()
    n_elig = x.eligible.numel()
    if dev.numel() == n_elig and n_elig != x.n_context:
        full = torch.zeros(x.n_context)
        full[x.eligible] = dev
        dev = full
    chosen = torch.sort(_top(dev, x.eligible, x.per_layer)).values
    return sets + [chosen.clone() for _ in range(x.n_layers - n_full)]


def _exit_layers(x: AnchorInputs) -> list[torch.Tensor]:
    """relaxkv and its ablations: nested sets from each token's exit layer (module doc)."""
    exits = relaxkv_exit_layers(x.scores, x.chunk_spans, x.anchor_ratio, x.chunk_sink_tokens, x.layer_value,
                                x.chunk_sink_share, x.chunk_sink_order, x.markup, x.markup_share)
    return exits_to_anchor_sets(exits, x.n_layers)


#: ``PolicySpec.anchor_rule`` -> the rule: AnchorInputs -> n_layers int64 sorted sets, nested.
ANCHOR_RULES: Mapping[str, Callable[[AnchorInputs], list[torch.Tensor]]] = types.MappingProxyType({
    "every_eligible": _every_eligible,
    "none": _no_anchors,
    "chunk_openings": _chunk_openings,
    "uniform_random": _uniform_random,
    "mean_query_score": _mean_query_score,
    "check_layer_deviation": _check_layer_deviation,
    "exit_layers": _exit_layers,
})


def select_anchors(
    policy: Policy | str,
    scores: Optional[torch.Tensor],
    chunk_spans: Sequence[Span],
    n_context: int,
    anchor_ratio: float,
    rng: Optional[torch.Generator] = None,
    *,
    n_layers: Optional[int] = None,
    deviation: Optional[torch.Tensor] = None,
    check_layer: int = 1,
    chunk_sink_tokens: int | torch.Tensor = 4,
    layer_value: str = "uniform",
    chunk_sink_share: float = 1.0,
    chunk_sink_order: str = "offset",
    markup: Optional[torch.Tensor] = None,
    markup_share: float = 0.0,
) -> list[torch.Tensor]:
    """Anchor set of every layer for one request: the rule its spec names (``ANCHOR_RULES``).

    Args:
        policy: a ``Policy`` or its string value.
        scores: float [n_layers, n_context] query scores s_l; required by the policies whose spec
            ``needs_query_scores``, ignored otherwise.
        chunk_spans: chunk spans (see module doc); anchors come only from eligible tokens.
        n_context: number of context tokens.
        anchor_ratio: r in [0, 1] (module doc).  epic / prophetkv / random /
            relaxkv*: ratio met within one token per layer.  cacheblend: layers
            0..check_layer recompute every eligible token (the method's check pass, so its
            mean ratio is higher than r); later layers keep round(r * n_eligible) tokens.
        rng: generator for the ``random`` policy.
        n_layers: needed when ``scores`` is None.
        deviation: float [n_context] (or [n_eligible] aligned with ``eligible_tokens``),
            cacheblend's K/V deviation at the check layer.  Without it cacheblend returns only
            the full layers 0..check_layer (the executor calls again once it has it).
        check_layer: cacheblend's check layer.
        chunk_sink_tokens: relaxkv's favoured first tokens of each chunk (one count, or int64
            [n_chunks]).
        layer_value: relaxkv's layer value rule (:func:`layer_weights`).
        chunk_sink_share, chunk_sink_order: how much of relaxkv's budget the chunk sinks take
            first, and which (:func:`relaxkv_exit_layers`).
        markup, markup_share: bool [n_context] the template markup every chunk repeats, and the
            largest share of relaxkv's budget it takes every layer (:func:`relaxkv_exit_layers`).

    Returns:
        n_layers int64 tensors of sorted token indices, nested (A_0 ⊇ A_1 ⊇ ...).
        full: every eligible token; pic: empty sets.
    
    Example (relaxkv, 25% of two 16-token chunks' token-layers, 4 layers):

    >>> import torch
    >>> scores = torch.rand(4, 40, generator=torch.Generator().manual_seed(0))
    >>> sets = select_anchors("relaxkv", scores, [(4, 20), (20, 36)], 40, 0.25, layer_value="ramp")
    >>> sum(len(a) for a in sets) == round(0.25 * 4 * 32)  # the budget, met exactly
    True
    >>> all(set(b.tolist()) <= set(a.tolist()) for a, b in zip(sets, sets[1:]))  # nested
    True
    """
    spec = policy_spec(policy)
    if scores is not None:
        if scores.dim() != 2 or scores.shape[1] != n_context:
            raise ValueError(f"scores must be [n_layers, {n_context}], got {tuple(scores.shape)}")
        n_layers = scores.shape[0] if n_layers is None else n_layers
    if n_layers is None:
        raise ValueError("n_layers is required when scores is None")
    elig = eligible_tokens(chunk_spans, n_context)
    per_layer = anchor_budget(anchor_ratio, elig.numel())
    if spec.needs_query_scores and scores is None:
        raise ValueError(f"{spec.policy.value} needs query scores")
    inputs = AnchorInputs(scores, chunk_spans, n_context, n_layers, anchor_ratio, elig, per_layer, rng, deviation,
                          check_layer, chunk_sink_tokens, layer_value, chunk_sink_share, chunk_sink_order, markup,
                          markup_share)
    return ANCHOR_RULES[spec.anchor_rule](inputs)


def anchor_ratio_achieved(anchor_sets: Sequence[torch.Tensor], n_eligible: int) -> float:
    """mean over layers of |A_l| / n_eligible (0.0 when nothing is eligible)."""
    if n_eligible == 0 or not anchor_sets:
        return 0.0
    return sum(int(a.numel()) for a in anchor_sets) / (len(anchor_sets) * n_eligible)
