"""Repair targets: query attention scores and per-layer anchor sets for every policy.

Vocabulary (token indices are absolute prompt positions):

* ``n_context``: tokens before ``query_start`` (prefix + chunks).
* ``chunk_spans``: ``[(start, end), ...]`` half-open spans of the reused chunks, sorted and
  non-overlapping, inside ``[0, n_context)``.
* *eligible* tokens: tokens of chunks that do **not** start at position 0.  Prefix tokens are
  exact and never anchors; a chunk that starts at position 0 was computed alone at positions
  ``0..len-1``, which is exactly what full prefill computes for it, so its cached KV is exact
  too and recomputing it would waste budget.
* anchor ratio ``r = mean over layers of |A_l| / n_eligible``.  The denominator is the number
  of repairable (eligible) tokens, not all context tokens: the exact prefix can never be
  repaired, so counting it would make ``r = 1`` unreachable.  With no prefix and no chunk at
  position 0 the two definitions coincide.

Nesting: a token recomputed at layer ``l`` needs its input hidden state at layer ``l``, which
exists only if it was recomputed at layer ``l-1``.  Every policy therefore returns
``A_0 ⊇ A_1 ⊇ ...``, equivalently each token ``t`` has an *exit layer* ``e(t)`` in
``0..n_layers`` and ``t ∈ A_l  <=>  l < e(t)``.  The cost of a token is ``e(t)``
token-layers, so the budget ``B = round(r * n_layers * n_eligible)`` is a sum of exit layers.

RelaxKV exit-layer rule (``relaxkv_exit_layers``): a token recomputed at layer ``l`` is worth
``u_l(t) = s_l(t) / sum_eligible s_l`` (the query's attention mass at that layer, normalised per
layer so that each layer weighs the same).  Keeping ``t`` until ``e`` is worth
``C_t(e) = sum_{l<e} u_l(t)`` and costs ``e``.  We maximise ``sum_t C_t(e(t))`` subject to
``sum_t e(t) = B``: per token take the upper concave hull of ``(e, C_t(e))``, then spend the
budget on whole hull segments in decreasing slope order (the LP optimum up to the one segment
that does not fit; that remainder goes to the single extension with the largest real gain).
A token needed only at a deep layer is thus kept at all shallower layers iff its average value
per token-layer is high enough.  The budget is met exactly, so mean_l |A_l| is within
``0.5 / n_layers`` tokens of ``r * n_eligible`` (well within one token per layer).

Layer value (``layer_weights``, ``RelaxKVOptions.layer_value``): ``u_l(t)`` is multiplied by a
weight ``w_l``.  A chunk token's layer-0 K/V depend only on the token and its position, so after
re-rotation they are already exact: recomputing a token at layer 0 alone changes nothing, and
``w_0 = 0`` for every rule but ``uniform`` (kept for ablations).  The deviation of the stale K/V
from the full prefill's grows with depth (SmolLM2-135M: relative V error 0 at layer 0, ~0.1 at
layer 1, ~0.25 by layer 5, ~0.3 at the last layers), and an error in a late layer reaches the
output with fewer layers left to wash it out. ``ramp`` (the default; ``w_l = min(1, l / R)``,
``R = round(L / 8)``, 4 layers of SmolLM2's 30) follows that measured shape: it grows over the
first layers and is flat after; ``depth`` (``w_l = l / (L - 1)``) credits late layers most,
``skip0`` only drops layer 0. ``ramp`` has the lowest mean KL on the development split
(``docs/experiments/2026-12-01-glue-correction-ramp.md``; ``docs/results/ablate_ramp_dev.json``).

Chunk sinks: each independently computed chunk grows its own attention sink on its first
tokens (EPIC's finding; StreamingLLM found ~4 initial tokens carry the sink).  In the full
prompt those tokens are ordinary mid-sequence tokens, so their stale KV is among the most wrong
and the query's stale attention is drawn to them.  RelaxKV policies therefore give the first
``chunk_sink_tokens`` (default 4, the StreamingLLM sink size) of each eligible chunk every layer
first, as long as the budget allows, then run the hull allocation on the rest.
``chunk_sink_share`` caps the sinks' share of the budget and ``chunk_sink_order`` says which come
first (``offset``: every chunk's first token, then every second, ...; ``score``: by their summed
layer value); both are ablations, neither beat the defaults
(``docs/experiments/2026-12-01-cheap-end.md``; ``docs/results/ablate_dev_sink_share_5pct.json``).
The count may differ per chunk (``chunk_sink_tokens`` as an int64 [n_chunks] tensor):
``shared_opening_sinks`` sizes each chunk's sinks from the prompt's tokens, the opening the chunk
shares with another chunk of the request plus its first token of its own
(``RelaxKVOptions.chunk_sink_rule="shared"``). The reading behind it: every chunk computed alone
turns its first token into a sink, and when chunks open with the same tokens (a ``Document:``
label) those tokens come back with the same stale K/V in every chunk, so the query meets the same
false sink once per chunk. It is an ablation, worse than the fixed 4 sinks at 5% and 15% anchors
(``docs/results/ablate_dev_shared_sinks.json``).

Anchor rules (``ANCHOR_RULES``): each policy's spec (``policies.POLICY_SPECS``) names the rule
that chooses its targets; :func:`select_anchors` checks the inputs once, builds an
:class:`AnchorInputs` and calls that rule, so a rule is one function of one parameter object.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Callable, Mapping, Optional, Sequence

import torch

from .policies import LAYER_VALUES, SINK_ORDERS, Policy, policy_spec

Span = tuple[int, int]

__all__ = [
    "query_attention_scores",
    "eligible_tokens",
    "chunk_ids",
    "chunk_offsets",
    "shared_opening_sinks",
    "LAYER_VALUES",
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


# ----------------------------------------------------------------------------- token sets


def _check_spans(chunk_spans: Sequence[Span], n_context: int) -> list[Span]:
    spans = [(int(s), int(e)) for s, e in chunk_spans]
    prev = 0
    for s, e in spans:
        if not (prev <= s < e <= n_context):
            raise ValueError(f"chunk spans must be sorted, non-empty, inside [0, {n_context}): {spans}")
        prev = e
    return spans


def chunk_ids(chunk_spans: Sequence[Span], n_context: int) -> torch.Tensor:
    """Chunk index of every context token.

    Returns: int64 [n_context], -1 for tokens outside every chunk (the prefix).
    """
    ids = torch.full((n_context,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(_check_spans(chunk_spans, n_context)):
        ids[s:e] = i
    return ids


def eligible_tokens(chunk_spans: Sequence[Span], n_context: int) -> torch.Tensor:
    """Tokens that may be repaired: chunk tokens, except a chunk starting at position 0.

    Returns: int64 [n_eligible], sorted.
    """
    parts = [
        torch.arange(s, e) for s, e in _check_spans(chunk_spans, n_context) if s > 0
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def chunk_offsets(chunk_spans: Sequence[Span], elig: torch.Tensor, n_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset inside own chunk int64 [n_elig], chunk index int64 [n_elig]) of each token of ``elig``."""
    starts = torch.zeros(n_context, dtype=torch.long)
    for s, e in _check_spans(chunk_spans, n_context):
        starts[s:e] = s
    return elig - starts[elig], chunk_ids(chunk_spans, n_context)[elig]


def shared_opening_sinks(input_ids: torch.Tensor, chunk_spans: Sequence[Span], max_sinks: int) -> torch.Tensor:
    """Sinks per chunk from its opening (module doc, "Chunk sinks"): 1 + the longest opening it
    shares with another chunk of the request, at most ``max_sinks``.

    Args:
        input_ids: int64 [n_tokens] the request's prompt.
        chunk_spans: the chunks inside it.
        max_sinks: the cap (``RepairConfig.chunk_sink_tokens``).
    Returns:
        int64 [n_chunks]; 0 everywhere when ``max_sinks`` is 0.
    """
    n = len(chunk_spans)
    if n == 0 or max_sinks <= 0:
        return torch.zeros(n, dtype=torch.long)
    ids = input_ids.flatten().to(torch.long)
    # Each chunk's first max_sinks tokens; a short chunk is padded with a value only it has.
    openings = torch.stack([-torch.full((max_sinks,), c + 1, dtype=torch.long) for c in range(n)])
    for c, (s, e) in enumerate(chunk_spans):
        m = min(max_sinks, e - s)
        openings[c, :m] = ids[s:s + m]
    same = (openings[:, None, :] == openings[None, :, :]).long().cumprod(dim=2).sum(dim=2)  # [n, n]
    same.fill_diagonal_(0)
    return (1 + same.max(dim=1).values).clamp(max=max_sinks)


def sinks_of_tokens(chunk_sink_tokens: int | torch.Tensor, cid: torch.Tensor) -> torch.Tensor | int:
    """The sink count that applies to each token of chunk index ``cid`` (int64 [n]): the one count,
    or the per-chunk counts (int64 [n_chunks]) read at ``cid``."""
    if isinstance(chunk_sink_tokens, torch.Tensor):
        return chunk_sink_tokens.to(torch.long)[cid]
    return chunk_sink_tokens


def _budget(ratio: float, units: int) -> int:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"anchor_ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * units + 0.5))


# ----------------------------------------------------------------------------- relaxkv


def _hull_exit_allocation(util: torch.Tensor, budget: int) -> torch.Tensor:
    """Exit layers for sum_t C_t(e_t) under sum_t e_t == budget: hull greedy (module doc).

    Args:
        util: float [n_tok, L] non-negative value of keeping token t at layer l.
        budget: total token-layers to hand out, 0 <= budget <= n_tok * L.
    Returns:
        int64 [n_tok] exit layers in 0..L.
    """
    n_tok, L = util.shape
    exits = torch.zeros(n_tok, dtype=torch.long)
    if budget <= 0 or n_tok == 0:
        return exits
    util = util.double()  # hull slopes compare sums; double keeps ties stable
    cum = torch.cat([torch.zeros(n_tok, 1, dtype=util.dtype), util.cumsum(dim=1)], dim=1)
    e_grid = torch.arange(L + 1)
    seg_tok, seg_len, seg_slope = [], [], []
    rows = torch.arange(n_tok)
    idx, cur = rows, torch.zeros(n_tok, dtype=torch.long)  # the tokens whose hull is not done, and where they are
    for _ in range(L):  # every hull step advances by >= 1 layer
        if idx.numel() == 0:
            break
        c = cum[idx]  # only the unfinished hulls: most end after a step or two
        dx = (e_grid[None, :] - cur[:, None]).to(util.dtype)  # [n_active, L+1]
        dy = c - c.gather(1, cur[:, None])
        slope = torch.where(dx > 0, dy / dx.clamp(min=1), torch.full_like(dy, -math.inf))
        best = slope.max(dim=1).values
        # Farthest vertex among ties, so consecutive hull slopes strictly decrease.
        at_best = slope >= best[:, None]
        nxt = L - torch.flip(at_best, dims=[1]).to(torch.int8).argmax(dim=1)
        seg_tok.append(idx)
        seg_len.append(nxt - cur)
        seg_slope.append(best)
        go_on = nxt < L
        idx, cur = idx[go_on], nxt[go_on]
    tok = torch.cat(seg_tok)
    length = torch.cat(seg_len)
    slope = torch.cat(seg_slope)
    # Stable sort keeps each token's own segments in hull order even on equal slopes.
    order = torch.sort(slope, descending=True, stable=True).indices
    tok, length = tok[order], length[order]
    # Whole segments while they fit: a prefix of the slope order, hence a prefix of every
    # token's own hull (nesting-consistent).
    fits = length.cumsum(0) <= budget
    exits.index_add_(0, tok[fits], length[fits])
    rest = budget - int(exits.sum())
    if rest > 0:
        # The first segment that does not fit would be cut, and a cut hull segment can be
        # worth nothing (value may sit at its far end).  Spend the remainder where it gains
        # most in real value instead; the cut token itself is always a candidate.
        room = exits + rest <= L
        gain = cum[rows, (exits + rest).clamp(max=L)] - cum[rows, exits]
        gain = torch.where(room, gain, torch.full_like(gain, -math.inf))
        exits[int(torch.argmax(gain))] += rest
    return exits


def layer_weights(n_layers: int, rule: str) -> torch.Tensor:
    """Weight w_l of correcting a token's KV at layer l (module doc: "Layer value").

    Args:
        n_layers: L.
        rule: ``uniform`` (w_l = 1), ``skip0`` (w_0 = 0, else 1), ``depth`` (w_l = l / (L - 1)) or
            ``ramp`` (w_l = min(1, l / R), R = max(1, round(L / 8)): the measured deviation's shape,
            growing over the first layers and flat after).
    Returns:
        float64 [L].
    """
    if rule not in LAYER_VALUES:
        raise ValueError(f"unknown layer value rule {rule!r}; choose one of {', '.join(LAYER_VALUES)}")
    w = torch.ones(n_layers, dtype=torch.float64)
    if rule == "depth":
        w = torch.arange(n_layers, dtype=torch.float64) / max(n_layers - 1, 1)
    if rule == "ramp":
        w = (torch.arange(n_layers, dtype=torch.float64) / max(1, round(n_layers / 8))).clamp(max=1.0)
    if rule != "uniform":
        w[0] = 0.0
    return w


def relaxkv_exit_layers(
    scores: torch.Tensor,
    chunk_spans: Sequence[Span],
    anchor_ratio: float,
    chunk_sink_tokens: int | torch.Tensor = 4,
    layer_value: str = "uniform",
    chunk_sink_share: float = 1.0,
    chunk_sink_order: str = "offset",
) -> torch.Tensor:
    """RelaxKV exit layer of every context token (module doc: "RelaxKV exit-layer rule").

    Args:
        scores: float [n_layers, n_context], s_l(t) from ``query_attention_scores``.
        chunk_spans: chunk spans inside the context.
        anchor_ratio: r in [0, 1]; sum of exit layers == round(r * n_layers * n_eligible).
        chunk_sink_tokens: first tokens of each eligible chunk that get every layer first: one
            count, or int64 [n_chunks] one per chunk (``shared_opening_sinks``).
        layer_value: the rule of :func:`layer_weights`.
        chunk_sink_share: the largest share of the budget those sinks take (the rest of them
            compete in the hull allocation like any token).
        chunk_sink_order: which sinks first when they do not all fit: ``offset`` (EPIC order:
            every chunk's first token, then every chunk's second, ...) or ``score`` (their
            value summed over layers, highest first).
    Returns:
        int64 [n_context]; 0 for non-eligible tokens.
    """
    if chunk_sink_order not in SINK_ORDERS:
        raise ValueError(f"chunk_sink_order must be one of {', '.join(SINK_ORDERS)}, got {chunk_sink_order!r}")
    L, n_context = scores.shape
    weights = layer_weights(L, layer_value)
    elig = eligible_tokens(chunk_spans, n_context)
    exits = torch.zeros(n_context, dtype=torch.long)
    budget = _budget(anchor_ratio, L * elig.numel())
    if budget == 0:
        return exits
    s = scores[:, elig].double().clamp(min=0)  # [L, n_elig]
    tot = s.sum(dim=1, keepdim=True)
    # A layer whose mass on eligible tokens is zero carries no preference: uniform.
    norm = torch.where(tot > 0, s / tot.clamp(min=1e-300), torch.full_like(s, 1.0 / elig.numel()))
    norm = norm * weights[:, None]
    offs, cid = chunk_offsets(chunk_spans, elig, n_context)
    sink_mask = offs < sinks_of_tokens(chunk_sink_tokens, cid)
    if chunk_sink_order == "score":
        key = -norm.sum(dim=0)[sink_mask]
    else:  # EPIC order (offset, then chunk) so a short budget spreads over chunks
        key = (offs * (int(cid.max()) + 1) + cid)[sink_mask].double()
    sinks = elig[sink_mask][torch.argsort(key, stable=True)]
    n_full = min(sinks.numel(), int(chunk_sink_share * budget) // L)
    exits[sinks[:n_full]] = L
    budget -= n_full * L
    rest = elig[exits[elig] == 0]
    if budget > 0 and rest.numel():
        pos_in_elig = torch.searchsorted(elig, rest)
        exits[rest] = _hull_exit_allocation(norm[:, pos_in_elig].T.contiguous(), budget)
    return exits


def exits_to_anchor_sets(exits: torch.Tensor, n_layers: int) -> list[torch.Tensor]:
    """Nested anchor sets from exit layers.

    Args:
        exits: int64 [n_context], token t is an anchor at layers 0..exits[t]-1.
    Returns:
        n_layers int64 tensors, sorted token indices, A_0 ⊇ A_1 ⊇ ...
    """
    return [(exits > l).nonzero().squeeze(1) for l in range(n_layers)]


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
        chunk_sink_tokens, layer_value, chunk_sink_share, chunk_sink_order: relaxkv's
            (:func:`relaxkv_exit_layers`).
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
                                x.chunk_sink_share, x.chunk_sink_order)
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

    Returns:
        n_layers int64 tensors of sorted token indices, nested (A_0 ⊇ A_1 ⊇ ...).
        full: every eligible token; pic: empty sets.
    """
    spec = policy_spec(policy)
    if scores is not None:
        if scores.dim() != 2 or scores.shape[1] != n_context:
            raise ValueError(f"scores must be [n_layers, {n_context}], got {tuple(scores.shape)}")
        n_layers = scores.shape[0] if n_layers is None else n_layers
    if n_layers is None:
        raise ValueError("n_layers is required when scores is None")
    elig = eligible_tokens(chunk_spans, n_context)
    per_layer = _budget(anchor_ratio, elig.numel())
    if spec.needs_query_scores and scores is None:
        raise ValueError(f"{spec.policy.value} needs query scores")
    inputs = AnchorInputs(scores, chunk_spans, n_context, n_layers, anchor_ratio, elig, per_layer, rng, deviation,
                          check_layer, chunk_sink_tokens, layer_value, chunk_sink_share, chunk_sink_order)
    return ANCHOR_RULES[spec.anchor_rule](inputs)


def anchor_ratio_achieved(anchor_sets: Sequence[torch.Tensor], n_eligible: int) -> float:
    """mean over layers of |A_l| / n_eligible (0.0 when nothing is eligible)."""
    if n_eligible == 0 or not anchor_sets:
        return 0.0
    return sum(int(a.numel()) for a in anchor_sets) / (len(anchor_sets) * n_eligible)
