"""Stale shift: correct the non-anchors' stale K/V by the mean deviation the anchors measure.

At layer l the repair holds, for each anchor, both its stale K/V (the chunk computed alone,
re-rotated) and its recomputed K/V; their mean difference is the part of the stale error every
stale token shares. Adding it to the non-anchors moves the query's attention on them back toward
full prefill's. With ``R(p)`` the rotation by p positions:

* ``dv_l = mean_{a in S_l} (v_new(a) - v_stale(a))``, per KV head and dimension;
* ``dk_l = mean_{a in S_l} R(-a) (k_new(a) - k_stale(a))`` (K compared before RoPE), and a shifted
  token t gets ``k(t) += scale * R(t) dk_l``, ``v(t) += scale * dv_l``;
* ``S_l``: the anchors of layer l outside the first ``chunk_sink_tokens`` of their chunk (a chunk
  sink's error is its own);
* shifted tokens ``T_l``: the eligible non-anchors of layer l outside those sinks. Prefix, glue
  and query tokens are never stale.

``RelaxKVOptions.stale_shift``: ``kv`` (both), ``v`` (V only), ``none``; ``stale_shift_scale``:
the fraction added. Groups (``stale_shift_group``): ``request``, one mean over S_l; ``chunk``, each
target its own chunk's anchors' mean shrunk toward the request's (:func:`group_means`,
``stale_shift_prior`` anchors of it).

Applied to each layer's stale K/V before that layer's attention; the request decodes from the
shifted K/V. The server computes the delta once (:func:`shift_deltas`) and adds it to the whole
body (:func:`shift_body`) before the layer's rows are written, so the anchors' recomputed K/V
overwrite it and exactly T_l stays shifted: one [n_context, Hkv, d] add per layer, no attention
pair. No anchor in S_l (``pic``) or no token in T_l (full prefill): nothing changes.

Why ``kv`` at 0.5: docs/experiments/INDEX.md#stale-shift.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from relaxkv_sglang.repair.token_sets import chunk_offsets, eligible_tokens, sinks_of_tokens

Span = tuple[int, int]

__all__ = ["shift_body", "split_body", "shift_sets", "group_means", "shift_deltas", "stale_shift"]


#: rotate(k [n or 1, Hkv, d], delta int64 [n]) -> k rotated by delta positions (RoPE composes);
#: one key with n deltas gives that key at each of them (``rope.rotate_keys``).
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shift_body(chunk_spans: Sequence[Span], n_context: int, chunk_sink_tokens: int | torch.Tensor) -> torch.Tensor:
    """int64 [n_body] sorted: the eligible tokens outside the first ``chunk_sink_tokens`` of their
    chunk (one count, or int64 [n_chunks] one per chunk), the tokens S_l and T_l of the module doc
    split between them (the same at every layer)."""
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
    """(S_l, T_l) of the module doc for one layer.

    Args:
        anchors: int64 [|A_l|] sorted anchors of the layer.
        chunk_spans: the reused chunks inside ``[0, n_context)``.
        n_context: context tokens.
        chunk_sink_tokens: first tokens of each chunk left out of both sets.
    Returns:
        (int64 [|S_l|] the anchors the mean is taken over, int64 [|T_l|] the tokens shifted), sorted.
    """
    return split_body(shift_body(chunk_spans, n_context, chunk_sink_tokens), anchors)


def group_means(rows: torch.Tensor, groups: torch.Tensor | None, n_groups: int, prior: float) -> torch.Tensor:
    """Each group's mean of ``rows``, shrunk toward the mean of all of them.

    ``m_c = (sum_{i in c} rows_i + prior * m) / (n_c + prior)`` with ``m`` the mean over every row:
    ``prior`` counts the request's mean as that many rows of each group, so a group with few
    anchors leans on it and a group with none takes it (also at ``prior = 0``).

    Args:
        rows: float32 [n, ...] one deviation per source (n >= 1).
        groups: int64 [n] the group of each row in ``[0, n_groups)``, or None (one group).
        n_groups: the number of groups.
        prior: the weight of the overall mean, >= 0.
    Returns:
        float32 [n_groups, ...].
    """
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
    """The layer's shift per group, once: ``(dk_l before RoPE, dv_l)`` of the module doc, scaled.

    Args:
        mode: ``none``, ``v`` or ``kv`` (``RelaxKVOptions.stale_shift``).
        sources: int64 [n_s] positions of S_l.
        k_new, v_new: [n_s, Hkv, d] their recomputed K (post-RoPE) and V.
        k_stale, v_stale: [n_s, Hkv, d] their stale K (post-RoPE, re-rotated) and V.
        rotate: RoPE re-rotation of post-RoPE keys by per-token position deltas.
        scale: the fraction of the mean deviation added (``RelaxKVOptions.stale_shift_scale``).
        groups, n_groups, prior: the sources' groups (int64 [n_s], on the sources' device; None:
            one group, the request) and the shrinkage toward the request's mean (:func:`group_means`).
    Returns:
        (dk float32 [n_groups, Hkv, d] before RoPE, dv float32 [n_groups, Hkv, d]); zeros where
        ``mode`` shifts nothing (``dk`` for ``v``, both for ``none``) or ``sources`` is empty.
    """
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
    """The shift of the targets' stale K/V (module doc): :func:`shift_deltas` at each target.

    Args:
        mode, sources, k_new, v_new, k_stale, v_stale, rotate, scale, groups, n_groups, prior: as
            :func:`shift_deltas`.
        targets: int64 [n_t] positions of T_l; target_groups: int64 [n_t] their groups (None: one group).
    Returns:
        (dk float32 [n_t, Hkv, d], dv float32 [n_t, Hkv, d]) to add to the targets' K and V;
        zeros when ``mode`` is ``none`` or ``sources`` is empty.
    """
    dk_pre, dv = shift_deltas(mode, sources, k_new, v_new, k_stale, v_stale, rotate, scale, groups, n_groups, prior)
    at = target_groups if target_groups is not None else torch.zeros_like(targets)
    n_t = int(targets.numel())
    dk = rotate(dk_pre[at], targets) if n_t else dk_pre[:0]  # R(t) dk at each target, its group's
    return dk.float(), dv[at].clone()
