"""Token sets of one request (absolute prompt positions): chunk indices, eligible tokens, chunk sinks, budgets.
*Eligible* tokens: those of chunks not starting at 0 (prefix tokens are exact; a chunk at 0 was computed alone at
``0..len-1``, as full prefill does); ``r = mean_l |A_l| / n_eligible`` counts only them, so ``r = 1`` is reachable."""

from __future__ import annotations

import math
from typing import Sequence

import torch

Span = tuple[int, int]

__all__ = ["check_spans", "chunk_ids", "eligible_tokens", "chunk_offsets", "shared_opening_sinks", "shared_runs",
           "sinks_of_tokens", "anchor_budget"]


def check_spans(chunk_spans: Sequence[Span], n_context: int) -> list[Span]:
    """The spans as int pairs; ValueError unless sorted, non-empty and inside ``[0, n_context)``."""
    spans = [(int(s), int(e)) for s, e in chunk_spans]
    prev = 0
    for s, e in spans:
        if not (prev <= s < e <= n_context):
            raise ValueError(f"chunk spans must be sorted, non-empty, inside [0, {n_context}): {spans}")
        prev = e
    return spans


def chunk_ids(chunk_spans: Sequence[Span], n_context: int) -> torch.Tensor:
    """int64 [n_context]: the chunk index of every context token, -1 outside every chunk (the prefix)."""
    ids = torch.full((n_context,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(check_spans(chunk_spans, n_context)):
        ids[s:e] = i
    return ids


def eligible_tokens(chunk_spans: Sequence[Span], n_context: int) -> torch.Tensor:
    """int64 [n_eligible] sorted: the chunk tokens, except a chunk starting at position 0."""
    parts = [
        torch.arange(s, e) for s, e in check_spans(chunk_spans, n_context) if s > 0
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def chunk_offsets(chunk_spans: Sequence[Span], elig: torch.Tensor, n_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset inside own chunk int64 [n_elig], chunk index int64 [n_elig]) of each token of ``elig``."""
    starts = torch.zeros(n_context, dtype=torch.long)
    for s, e in check_spans(chunk_spans, n_context):
        starts[s:e] = s
    return elig - starts[elig], chunk_ids(chunk_spans, n_context)[elig]


def shared_opening_sinks(input_ids: torch.Tensor, chunk_spans: Sequence[Span], max_sinks: int) -> torch.Tensor:
    """int64 [n_chunks] sinks per chunk: 1 + the longest opening it shares with another chunk of the prompt
    (``input_ids`` int64 [n_tokens]), at most ``max_sinks`` (0 everywhere when it is 0)."""
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


def shared_runs(input_ids: torch.Tensor, chunk_spans: Sequence[Span], n_context: int, run: int = 3) -> torch.Tensor:
    """bool [n_context]: the markup every chunk repeats (tokens inside some ``run`` consecutive ids found in every
    chunk); computed alone, each copy gets the same stale K/V."""
    spans = check_spans(chunk_spans, n_context)
    marked = torch.zeros(n_context, dtype=torch.bool)
    if len(spans) < 2 or run < 1:
        return marked
    ids = input_ids.flatten()[:n_context].tolist()
    runs = [{tuple(ids[t:t + run]) for t in range(s, e - run + 1)} for s, e in spans]
    common = set.intersection(*runs)
    for s, e in spans:
        for t in range(s, e - run + 1):
            if tuple(ids[t:t + run]) in common:
                marked[t:t + run] = True
    return marked


def sinks_of_tokens(chunk_sink_tokens: int | torch.Tensor, cid: torch.Tensor) -> torch.Tensor | int:
    """Each token's sink count (``cid`` int64 [n] its chunk): the one count, or int64 [n_chunks] read at ``cid``."""
    if isinstance(chunk_sink_tokens, torch.Tensor):
        return chunk_sink_tokens.to(torch.long)[cid]
    return chunk_sink_tokens


def anchor_budget(ratio: float, units: int) -> int:
    """round(ratio * units), half up; ValueError unless ratio is in [0, 1]."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"anchor_ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * units + 0.5))

