"""Token sets of one request: chunk indices, eligible (repairable) tokens, chunk sinks, budgets.

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
"""

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
    """Chunk index of every context token.

    Returns: int64 [n_context], -1 for tokens outside every chunk (the prefix).
    """
    ids = torch.full((n_context,), -1, dtype=torch.long)
    for i, (s, e) in enumerate(check_spans(chunk_spans, n_context)):
        ids[s:e] = i
    return ids


def eligible_tokens(chunk_spans: Sequence[Span], n_context: int) -> torch.Tensor:
    """Tokens that may be repaired: chunk tokens, except a chunk starting at position 0.

    Returns: int64 [n_eligible], sorted.
    """
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
    """Sinks per chunk from its opening (``exit_layers`` module doc): 1 + the longest opening it
    shares with another chunk of the request, at most ``max_sinks``.

    Args:
        input_ids: int64 [n_tokens] the request's prompt.
        chunk_spans: the chunks inside it.
        max_sinks: the cap (``RelaxKVOptions.chunk_sink_tokens``).
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


def shared_runs(input_ids: torch.Tensor, chunk_spans: Sequence[Span], n_context: int, run: int = 3) -> torch.Tensor:
    """The tokens of the template markup every chunk of the request repeats: each token inside some
    ``run`` consecutive token ids that occur in every chunk (``</source><document_content>`` when a
    framework wraps each document in tags). Computed alone, each copy of the markup gets the same
    stale K/V, so the query meets the same wrong structure once per chunk (``exit_layers`` module doc,
    "Template markup"; ``scripts/measure_deviation.py`` measures it).

    Args:
        input_ids: int64 [>= n_context] the request's prompt.
        chunk_spans: the chunks inside it.
        n_context: the context length.
        run: how many consecutive ids make a repeated run.
    Returns:
        bool [n_context]; all False with fewer than two chunks or no run shared by all.
    """
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
    """The sink count that applies to each token of chunk index ``cid`` (int64 [n]): the one count,
    or the per-chunk counts (int64 [n_chunks]) read at ``cid``."""
    if isinstance(chunk_sink_tokens, torch.Tensor):
        return chunk_sink_tokens.to(torch.long)[cid]
    return chunk_sink_tokens


def anchor_budget(ratio: float, units: int) -> int:
    """round(ratio * units), half up; ValueError unless ratio is in [0, 1]."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"anchor_ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * units + 0.5))

