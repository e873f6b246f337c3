"""RelaxKV's targets: an exit layer per token from the query's per-layer attention.

Nesting: a token recomputed at layer ``l`` needs its input hidden state at layer ``l``, which
exists only if it was recomputed at layer ``l-1``.  Every anchor rule therefore returns
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

Template markup (``markup``, ``markup_share``; ``RelaxKVOptions.markup_share``): when a framework
wraps every document in the same tags (``<document_content>...</document_content>``), each chunk
carries a copy of that markup, computed alone, with the same stale K/V in every chunk.  The
deviation measurements (``scripts/measure_deviation.py``) put much of such a layout's error on
those copies.  ``markup`` marks them (``token_sets.shared_runs``: runs of token ids present in
every chunk); after the chunk sinks they get every layer, query-ranked (summed layer value) and at
most ``markup_share`` of the budget, then the hull allocation spends the rest.  An ablation, off
by default: at 0.5 it cut SmolLM2's ``tagged`` KL by 61% on one development batch, but pooled with
``llamaindex`` (where it is level) the calibration's paired interval included 0 on two batches
(``docs/experiments/2026-12-03-template-markup.md``).

"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .policies import LAYER_VALUES, SINK_ORDERS
from .token_sets import anchor_budget, chunk_offsets, eligible_tokens, sinks_of_tokens

Span = tuple[int, int]

__all__ = ["layer_weights", "relaxkv_exit_layers", "exits_to_anchor_sets"]


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
    markup: torch.Tensor | None = None,
    markup_share: float = 0.0,
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
        markup: bool [n_context] the template markup every chunk repeats, or None (module doc,
            "Template markup").
        markup_share: the largest share of the budget the markup takes every layer, after the sinks.
    Returns:
        int64 [n_context]; 0 for non-eligible tokens.
    """
    if chunk_sink_order not in SINK_ORDERS:
        raise ValueError(f"chunk_sink_order must be one of {', '.join(SINK_ORDERS)}, got {chunk_sink_order!r}")
    L, n_context = scores.shape
    weights = layer_weights(L, layer_value)
    elig = eligible_tokens(chunk_spans, n_context)
    exits = torch.zeros(n_context, dtype=torch.long)
    total = budget = anchor_budget(anchor_ratio, L * elig.numel())
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
    if markup is not None and markup_share > 0:
        marked = markup[elig] & (exits[elig] == 0)
        order = torch.argsort(-norm.sum(dim=0)[marked], stable=True)  # the query's first
        n_marked = min(int(marked.sum()), int(markup_share * total) // L, budget // L)
        exits[elig[marked][order[:n_marked]]] = L
        budget -= n_marked * L
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

