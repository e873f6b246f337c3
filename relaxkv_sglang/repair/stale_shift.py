"""Stale shift: correct the non-anchors' stale K/V by the mean deviation the anchors measure.

The anchors' mean difference between recomputed and stale (the chunk alone, re-rotated) K/V at layer l is the part of
the stale error every stale token shares: ``dv_l = mean_{a in S_l} (v_new(a) - v_stale(a))``, ``dk_l = mean_{a in
S_l} R(-a) (k_new(a) - k_stale(a))`` (K compared before RoPE, ``R(p)`` the rotation by p); a shifted token t gets
``k(t) += scale * R(t) dk_l``, ``v(t) += scale * dv_l``. ``S_l`` / ``T_l``: the anchors / eligible non-anchors of
layer l outside their chunk's sinks (a sink's error is its own). The server adds the delta to the whole body before
the layer's rows are written, which overwrite it on the anchors: one add per layer, no attention pair. Why ``kv`` at
0.5: docs/experiments/INDEX.md#stale-shift."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from relaxkv_sglang.repair.token_sets import chunk_offsets, eligible_tokens, sinks_of_tokens

Span = tuple[int, int]

__all__ = ["shift_body", "split_body", "shift_sets", "group_means", "shift_deltas", "stale_shift"]


#: rotate(k [n or 1, Hkv, d], delta int64 [n]) -> k rotated by delta positions; one key with n deltas: each.
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shift_body(chunk_spans: Sequence[Span], n_context: int, chunk_sink_tokens: int | torch.Tensor) -> torch.Tensor:
    """int64 [n_body] sorted: the eligible tokens outside their chunk's first ``chunk_sink_tokens``."""
    elig = eligible_tokens(chunk_spans, n_context)
    if elig.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    offset, cid = chunk_offsets(chunk_spans, elig, n_context)
    return elig[offset >= sinks_of_tokens(chunk_sink_tokens, cid)]


def split_body(body: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_l, T_l): ``body`` (:func:`shift_body`) split by the layer's sorted anchors ``A_l``."""
    is_anchor = torch.isin(body, anchors.to(body.device))
    return body[is_anchor], body[~is_anchor]


def shift_sets(anchors: torch.Tensor, chunk_spans: Sequence[Span], n_context: int,
               chunk_sink_tokens: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_l, T_l) for ``anchors`` int64 [|A_l|] sorted: int64 [|S_l|], int64 [|T_l|], sorted."""
    return split_body(shift_body(chunk_spans, n_context, chunk_sink_tokens), anchors)


def group_means(rows: torch.Tensor, groups: torch.Tensor | None, n_groups: int, prior: float) -> torch.Tensor:
    """float32 [n_groups, ...]: each group's mean of ``rows`` (float32 [n, ...]; ``groups`` int64 [n] or None) shrunk
    toward the overall mean ``m``, ``(sum_{i in c} rows_i + prior * m) / (n_c + prior)``."""
    mean = rows.mean(dim=0, keepdim=True)
    if groups is None or n_groups == 1:
        return mean.expand(n_groups, *rows.shape[1:]).clone()
    sums = rows.new_zeros(n_groups, *rows.shape[1:]).index_add_(0, groups, rows)
    counts = rows.new_zeros(n_groups).index_add_(0, groups, rows.new_ones(groups.shape[0]))
    counts = counts.view(n_groups, *([1] * (rows.dim() - 1)))
    shrunk = (sums + prior * mean) / (counts + prior).clamp_min(1e-12)
    return torch.where(counts + prior > 0, shrunk, mean)


def shift_deltas(mode: str, sources: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_stale: torch.Tensor, v_stale: torch.Tensor, rotate: Rotate,
                 scale: float = 1.0, groups: torch.Tensor | None = None, n_groups: int = 1,
                 prior: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's shift per group: (dk float32 [n_groups, Hkv, d] before RoPE, dv float32 [n_groups, Hkv, d]), scaled;
    zeros where ``mode`` shifts nothing or ``sources`` (int64 [n_s], S_l) is empty. ``*_new`` [n_s, Hkv, d]
    recomputed (K post-RoPE), ``*_stale`` [n_s, Hkv, d] re-rotated; ``groups`` int64 [n_s] or None."""
    if mode not in ("none", "v", "kv"):  # policies.relaxkv.STALE_SHIFTS, checked equal
        raise ValueError(f"unknown stale_shift {mode!r}")
    zeros = torch.zeros(n_groups, *v_new.shape[1:], dtype=torch.float32, device=v_new.device)
    if mode == "none" or sources.numel() == 0:
        return zeros, zeros.clone()
    dv = group_means(v_new.float() - v_stale.float(), groups, n_groups, prior) * scale
    if mode == "v":
        return zeros, dv
    dk = group_means(rotate(k_new.float() - k_stale.float(), -sources), groups, n_groups, prior) * scale
    return dk, dv


def stale_shift(mode: str, sources: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_stale: torch.Tensor,
                v_stale: torch.Tensor, targets: torch.Tensor, rotate: Rotate,
                scale: float = 1.0, groups: torch.Tensor | None = None, target_groups: torch.Tensor | None = None,
                n_groups: int = 1, prior: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) float32 [n_t, Hkv, d] to add to the K/V of ``targets`` (int64 [n_t], T_l; ``target_groups`` int64 [n_t]
    or None): :func:`shift_deltas` at each target."""
    dk_pre, dv = shift_deltas(mode, sources, k_new, v_new, k_stale, v_stale, rotate, scale, groups, n_groups, prior)
    at = target_groups if target_groups is not None else torch.zeros_like(targets)
    n_t = int(targets.numel())
    dk = rotate(dk_pre[at], targets) if n_t else dk_pre[:0]  # R(t) dk at each target, its group's
    return dk.float(), dv[at].clone()
