"""RelaxKV's targets: an exit layer ``e(t)`` per token (``t ∈ A_l <=> l < e(t)``) from the query's attention.

Recomputing ``t`` at ``l`` is worth ``u_l(t) = w_l s_l(t) / sum_eligible s_l``; keeping it until ``e`` is worth
``C_t(e) = sum_{l<e} u_l(t)``. Maximise ``sum_t C_t(e(t))`` subject to ``sum_t e(t) = round(r * n_layers *
n_eligible)``: spend the budget on whole segments of each token's upper concave hull of ``(e, C_t(e))`` by decreasing
slope (the LP optimum up to the one segment that does not fit; its remainder goes to the extension with the largest
real gain). First, every layer goes to the chunk sinks (the first ``chunk_sink_tokens`` of each eligible chunk: a
chunk computed alone makes them its attention sink), at most ``chunk_sink_share`` of the budget, then to the markup
every chunk repeats, at most ``markup_share`` (why: docs/experiments/INDEX.md#exit-layers)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from relaxkv_sglang.repair.token_sets import anchor_budget, chunk_offsets, eligible_tokens, sinks_of_tokens

Span = tuple[int, int]

__all__ = ["layer_weights", "relaxkv_exit_layers", "exits_to_anchor_sets"]


def _hull_exit_allocation(util: torch.Tensor, budget: int) -> torch.Tensor:
    """Exit layers (int64 [n_tok], in 0..L) from ``util`` float [n_tok, L] >= 0 (module doc)."""
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
    # Whole segments while they fit: a prefix of every token's own hull (nesting-consistent).
    fits = length.cumsum(0) <= budget
    exits.index_add_(0, tok[fits], length[fits])
    rest = budget - int(exits.sum())
    if rest > 0:
        # A cut hull segment can be worth nothing (its value may sit at its far end); the cut token is a candidate.
        room = exits + rest <= L
        gain = cum[rows, (exits + rest).clamp(max=L)] - cum[rows, exits]
        gain = torch.where(room, gain, torch.full_like(gain, -math.inf))
        exits[int(torch.argmax(gain))] += rest
    return exits


def layer_weights(n_layers: int, rule: str) -> torch.Tensor:
    """float64 [L] w_l: ``uniform`` 1; ``skip0`` 1 but w_0 = 0; ``depth`` l / (L - 1); ``ramp`` min(1, l / R), R =
    max(1, round(L / 8)) (the measured deviation's shape). w_0 = 0: layer-0 K/V are exact once re-rotated."""
    if rule not in ("uniform", "skip0", "depth", "ramp"):  # policies.relaxkv.LAYER_VALUES, checked equal
        raise ValueError(f"unknown layer value rule {rule!r}")
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
    """int64 [n_context] the exit layer of every context token; ``scores`` float [n_layers, n_context] s_l(t);
    ``chunk_sink_tokens`` one count or int64 [n_chunks]; sinks beyond ``chunk_sink_share`` compete in the hull;
    ``chunk_sink_order`` ``offset`` (EPIC's: every chunk's first token, then every second, ...) or ``score``;
    ``markup`` bool [n_context] or None."""
    if chunk_sink_order not in ("offset", "score"):  # policies.relaxkv.SINK_ORDERS, checked equal
        raise ValueError(f"unknown chunk_sink_order {chunk_sink_order!r}")
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
    """n_layers int64 sorted sets A_0 ⊇ A_1 ⊇ ... from ``exits`` int64 [n_context]."""
    return [(exits > l).nonzero().squeeze(1) for l in range(n_layers)]

