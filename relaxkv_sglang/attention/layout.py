"""Relaxed recomputation context of the anchors as a block-sparse (BSR) layout, in plain torch.

Key j is the context token at prompt position j; page i holds ``[i*page_size, (i+1)*page_size)``
(aligned to the prompt). A :class:`BlockSparseLayout`'s rows are one layer's anchors by position; a row
block (one per (page, chunk) of the anchors) lists its key pages ascending (CSR over pages). A row at t
sees key j iff ``page(j)`` is listed for its block and ``j <= t``. Anchor t's relaxed context at layer l
(:class:`RelaxedContextSpec`): the sink (the first ``sink_tokens``) and t's own chunk up to t, then other
pages by ``sum of s_l`` (ties: earlier first; per row block with ``row_page_scores``, Quest's key bound;
seeded random with ``mode='random'``) up to ``ceil(context_ratio * (page(t) + 1))`` pages, mandatory
ones included (``own_chunk_in_budget=False``: ``ceil(context_ratio * page(chunk_start))`` plus the own
chunk). Page sets are nested in ``context_ratio``; ``mode='full'``: every causal page. Why the default
ratio and own-chunk rule: docs/experiments/INDEX.md#context-ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

Span = tuple[int, int]

__all__ = [
    "BlockSparseLayout",
    "RelaxedContextSpec",
    "page_scores",
    "build_relaxed_layout",
    "build_relaxed_layouts",
    "key_bound_page_scores",
    "full_causal_layout",
]


def _n_pages(n_keys: int, page_size: int) -> int:
    return (n_keys + page_size - 1) // page_size


@dataclass
class BlockSparseLayout:
    """Query rows over prompt-ordered keys ``[0, n_keys)`` (module doc). q_pos int64 [n_rows], ascending
    within a block; row_indptr, indptr int32 [n_row_blocks + 1] (a block's rows; its entries of
    ``indices``); indices int32 [nnz] page ids, ascending within a block."""

    q_pos: torch.Tensor
    row_indptr: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    page_size: int
    n_keys: int

    @property
    def n_rows(self) -> int:
        return int(self.q_pos.numel())

    @property
    def n_row_blocks(self) -> int:
        return int(self.row_indptr.numel()) - 1

    @property
    def n_pages(self) -> int:
        return _n_pages(self.n_keys, self.page_size)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    def block_pages(self, b: int) -> torch.Tensor:
        """int64 [n_pages_b]."""
        return self.indices[int(self.indptr[b]):int(self.indptr[b + 1])].long()

    def block_key_index(self, b: int) -> torch.Tensor:
        """int64 [n_keys_b] ascending keys on block b's pages."""
        pages = self.block_pages(b)
        tok = (pages[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()
        return tok[tok < self.n_keys]

    def block_of_entry(self) -> torch.Tensor:
        """int64 [nnz]."""
        indptr = self.indptr.long()
        return torch.repeat_interleave(torch.arange(self.n_row_blocks), indptr[1:] - indptr[:-1])

    def kv_pairs(self) -> int:
        """One search per row in the page lists end to end, O(nnz + rows log nnz)."""
        if self.n_rows == 0 or self.nnz == 0:
            return 0
        ps, P = self.page_size, self.n_pages
        row_indptr, indptr = self.row_indptr.long(), self.indptr.long()
        pages = self.indices.long()
        keys = self.block_of_entry() * P + pages  # ascending
        length = (self.n_keys - pages * ps).clamp(max=ps)  # keys on each listed page
        cum = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(length, 0)])
        block_of_row = torch.repeat_interleave(torch.arange(self.n_row_blocks), row_indptr[1:] - row_indptr[:-1])
        t = self.q_pos.long().clamp(max=self.n_keys - 1)
        row_page = t // ps
        before = torch.searchsorted(keys, block_of_row * P + row_page)  # entries of pages < page(t) end here
        full = cum[before] - cum[indptr[block_of_row]]
        on_diagonal = before < keys.numel()
        on_diagonal &= keys[before.clamp(max=keys.numel() - 1)] == block_of_row * P + row_page
        return int(full.sum() + ((t - row_page * ps + 1) * on_diagonal).sum())

    def full_kv_pairs(self) -> int:
        return int((self.q_pos + 1).clamp(max=self.n_keys).sum())

    def context_ratio(self) -> float:
        """In tokens (1.0 for an empty layout)."""
        full = self.full_kv_pairs()
        return self.kv_pairs() / full if full else 1.0

    def to_dense_mask(self) -> torch.Tensor:
        """bool [n_rows, n_keys], for tests."""
        mask = torch.zeros(self.n_rows, self.n_keys, dtype=torch.bool)
        keys_all = torch.arange(self.n_keys)
        for b in range(self.n_row_blocks):
            r0, r1 = int(self.row_indptr[b]), int(self.row_indptr[b + 1])
            listed = torch.zeros(self.n_keys, dtype=torch.bool)
            listed[self.block_key_index(b)] = True
            mask[r0:r1] = listed[None, :] & (keys_all[None, :] <= self.q_pos[r0:r1, None])
        return mask

    @staticmethod
    def from_page_mask(
        q_pos: torch.Tensor,
        row_indptr: torch.Tensor,
        page_mask: torch.Tensor,
        page_size: int,
        n_keys: int,
    ) -> "BlockSparseLayout":
        """page_mask bool [n_row_blocks, n_pages]."""
        counts = page_mask.sum(dim=1)
        indptr = torch.zeros(page_mask.shape[0] + 1, dtype=torch.int32)
        indptr[1:] = counts.cumsum(0).to(torch.int32)
        # Row-major: ascending within each block.
        indices = page_mask.nonzero()[:, 1].to(torch.int32)
        return BlockSparseLayout(
            q_pos=q_pos.to(torch.long),
            row_indptr=row_indptr.to(torch.int32),
            indptr=indptr,
            indices=indices,
            page_size=int(page_size),
            n_keys=int(n_keys),
        )


def page_scores(scores: torch.Tensor, page_size: int) -> torch.Tensor:
    """float [n_layers?, n_keys] s_l -> float32 [n_layers?, n_pages], its sum over each page."""
    n = scores.shape[-1]
    pad = _n_pages(n, page_size) * page_size - n
    padded = torch.nn.functional.pad(scores.float(), (0, pad))
    return padded.view(*scores.shape[:-1], -1, page_size).sum(dim=-1)


@dataclass(frozen=True)
class RelaxedContextSpec:
    """What every layer's layout of a request shares (module doc). ``chunk_spans``: sorted, in
    ``[0, n_context)``; a token outside them has only its diagonal page as own chunk."""

    chunk_spans: tuple[Span, ...]
    n_context: int
    context_ratio: float = 1.0
    page_size: int = 16
    sink_tokens: int = 4
    mode: str = "topk"
    own_chunk_in_budget: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_spans", tuple((int(s), int(e)) for s, e in self.chunk_spans))
        if self.mode not in ("topk", "random", "full"):
            raise ValueError(f"unknown context mode {self.mode!r}")
        if not 0.0 <= self.context_ratio <= 1.0:
            raise ValueError(f"context_ratio must be in [0, 1], got {self.context_ratio}")


def build_relaxed_layout(
    anchors: torch.Tensor,
    scores: Optional[torch.Tensor],
    context: RelaxedContextSpec,
    generator: Optional[torch.Generator] = None,
    row_page_scores: Optional[torch.Tensor] = None,
) -> BlockSparseLayout:
    """One layer's relaxed context (module doc); rows: ``anchors``, int64 [n_anchors] sorted, < n_context.
    scores float [n_context] s_l (None for 'full'/'random'); row_page_scores float [n_anchors, n_pages]
    (:func:`key_bound_page_scores`): 'topk' then ranks per row block by their sum. Two chunks after a
    4-token prefix, pages of 8, half of each anchor's prefix:

    >>> import torch
    >>> context = RelaxedContextSpec([(4, 40), (40, 64)], n_context=64, context_ratio=0.5, page_size=8)
    >>> layout = build_relaxed_layout(torch.tensor([20, 21, 40, 63]), torch.arange(64.0), context)
    >>> layout.n_rows, layout.indptr.tolist(), layout.indices.tolist()
    (4, [0, 3, 6, 10], [0, 1, 2, 0, 4, 5, 0, 5, 6, 7])
    >>> layout.kv_pairs() < layout.full_kv_pairs()
    True
    """
    layer_scores = None if scores is None else scores[None, :context.n_context]
    return build_relaxed_layouts([anchors], layer_scores, context, generator, row_page_scores)[0]


def build_relaxed_layouts(
    anchor_sets: Sequence[torch.Tensor],
    scores: Optional[torch.Tensor],
    context: RelaxedContextSpec,
    generator: Optional[torch.Generator] = None,
    row_page_scores: Optional[torch.Tensor] = None,
) -> list[BlockSparseLayout]:
    """:func:`build_relaxed_layout` for many layers in one pass of tensor operations. scores float
    [n_sets, >= n_context]; ``generator`` draws one order per set with anchors, in set order;
    ``row_page_scores`` only with one set."""
    chunk_spans, n_context, context_ratio = context.chunk_spans, context.n_context, context.context_ratio
    page_size, sink_tokens, mode = context.page_size, context.sink_tokens, context.mode
    own_chunk_in_budget = context.own_chunk_in_budget
    if row_page_scores is not None and len(anchor_sets) != 1:
        raise ValueError("row_page_scores ranks the pages of one layer's anchors only")
    n_sets = len(anchor_sets)
    sets = [a.to(torch.long) for a in anchor_sets]
    anchors = torch.cat(sets) if sets else torch.zeros(0, dtype=torch.long)
    set_of_row = torch.repeat_interleave(torch.arange(n_sets),
                                         torch.tensor([a.numel() for a in sets], dtype=torch.long))
    same_set = set_of_row[1:] == set_of_row[:-1]
    if anchors.numel() and (bool(((anchors[1:] <= anchors[:-1]) & same_set).any()) or int(anchors.max()) >= n_context):
        raise ValueError("anchors must be strictly increasing and < n_context")
    P = _n_pages(n_context, page_size)
    chunk_of = torch.full((n_context,), -1, dtype=torch.long)
    chunk_start = torch.arange(n_context)  # non-chunk tokens: own "chunk" is just themselves
    for i, (s, e) in enumerate(chunk_spans):
        chunk_of[s:e] = i
        chunk_start[s:e] = s
    page, chunk = anchors // page_size, chunk_of[anchors]
    new = torch.ones(anchors.numel(), dtype=torch.bool)
    new[1:] = (page[1:] != page[:-1]) | (chunk[1:] != chunk[:-1]) | ~same_set
    starts = new.nonzero().squeeze(1)
    row_indptr = torch.cat([starts, torch.tensor([anchors.numel()])])
    blk_page, blk_set = page[starts], set_of_row[starts]
    own_first = chunk_start[anchors[starts]] // page_size  # [n_rb]
    cols = torch.arange(P)[None, :]
    causal = cols <= blk_page[:, None]
    n_sink_pages = _n_pages(min(sink_tokens, n_context), page_size)
    mandatory = causal & ((cols < n_sink_pages) | (cols >= own_first[:, None]))
    if mode == "full":
        mask = causal
    else:
        if own_chunk_in_budget:
            budget = torch.ceil(context_ratio * (blk_page + 1).double() - 1e-9).long()
            extra = (budget - mandatory.sum(dim=1)).clamp(min=0)  # [n_rb]
        else:  # a fraction of the pages before the own chunk; the sink pages among them count
            budget = torch.ceil(context_ratio * own_first.double() - 1e-9).long()
            extra = (budget - (mandatory & (cols < own_first[:, None])).sum(dim=1)).clamp(min=0)
        cand = causal & ~mandatory
        # A ranking shared across blocks and ratios makes the page sets nested in the ratio.
        if mode == "topk" and row_page_scores is not None:
            block_scores = _block_sums(row_page_scores.float(), row_indptr)
        elif mode == "topk":
            if scores is None:
                raise ValueError("mode 'topk' needs scores")
            block_scores = page_scores(scores[:, :n_context], page_size)[blk_set]
        else:  # a random order as scores: the first page drawn ranks highest
            rank_score = torch.zeros(n_sets, P)
            for i in torch.unique(blk_set).tolist():
                order = torch.randperm(P, generator=generator)
                rank_score[i, order] = torch.arange(P, 0, -1, dtype=torch.float32)
            block_scores = rank_score[blk_set]
        mask = mandatory | _take_per_block(cand, extra, block_scores)
    layouts, b0 = [], 0
    for a, n_blocks in zip(sets, torch.bincount(blk_set, minlength=n_sets).tolist()):
        b1 = b0 + n_blocks
        rows = row_indptr[b0:b1 + 1] - row_indptr[b0]
        layouts.append(BlockSparseLayout.from_page_mask(a, rows, mask[b0:b1], page_size, n_context))
        b0 = b1
    return layouts


def _block_sums(row_values: torch.Tensor, row_indptr: torch.Tensor) -> torch.Tensor:
    """float [n_rows, P] -> [n_row_blocks, P]."""
    block_of_row = torch.repeat_interleave(torch.arange(row_indptr.numel() - 1), row_indptr.diff().long())
    out = row_values.new_zeros(row_indptr.numel() - 1, row_values.shape[1])
    return out.index_add_(0, block_of_row, row_values)


def _take_per_block(cand: torch.Tensor, extra: torch.Tensor, block_scores: torch.Tensor) -> torch.Tensor:
    """bool [n_rb, P]: each block's ``extra`` best candidate pages by its own scores (ties: earlier page)."""
    ranked = torch.sort(block_scores.masked_fill(~cand, float("-inf")), dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(ranked)
    rank.scatter_(1, ranked, torch.arange(cand.shape[1]).expand_as(ranked).contiguous())
    return cand & (rank < extra[:, None])


def key_bound_page_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, n_keys: int, page_size: int,
                          scale: Optional[float] = None, exact: bool = False) -> torch.Tensor:
    """Each row's relevance of each page, Quest-style: a page's logit bound ``sum_d max(q_d m_{p,d},
    q_d M_{p,d})`` (its keys' element-wise min and max), softmaxed per head over the pages up to the
    row's own (so heads with large logits do not drown the others), summed over heads. ``exact``: the
    true attention mass instead (an ablation oracle, dense cost). q [n_rows, H, d]; q_pos int64
    [n_rows]; k [>= n_keys, H_kv, d] in prompt order -> float32 [n_rows, n_pages], rows summing to H."""
    n_rows, H, d = q.shape
    P = _n_pages(n_keys, page_size)
    s = d ** -0.5 if scale is None else float(scale)
    kk = k[:n_keys].float()
    group = H // kk.shape[1]
    if exact:
        logits = torch.einsum("rhd,khd->rkh", q.float(), kk.repeat_interleave(group, dim=1)) * s
        later = torch.arange(n_keys)[None, :] > q_pos[:, None]
        mass = torch.softmax(logits.masked_fill(later[..., None], float("-inf")), dim=1).sum(dim=2)
        pad = P * page_size - n_keys
        return torch.cat([mass, mass.new_zeros(n_rows, pad)], dim=1).view(n_rows, P, page_size).sum(dim=2)
    pad = P * page_size - n_keys
    if pad:  # pad by repeating the last key so the bounds stay those of the real keys
        kk = torch.cat([kk, kk[-1:].expand(pad, -1, -1)])
    kp = kk.view(P, page_size, kk.shape[1], d)
    k_min, k_max = kp.amin(dim=1), kp.amax(dim=1)  # [P, H_kv, d]
    k_min, k_max = k_min.repeat_interleave(group, dim=1), k_max.repeat_interleave(group, dim=1)
    qf = q.float()[:, None]  # [n_rows, 1, H, d]
    bound = torch.maximum(qf * k_min[None], qf * k_max[None]).sum(dim=-1)  # [n_rows, P, H]
    later = torch.arange(P)[None, :] > (q_pos // page_size)[:, None]
    return torch.softmax((bound * s).masked_fill(later[..., None], float("-inf")), dim=1).sum(dim=2)


def full_causal_layout(
    anchors: torch.Tensor,
    chunk_spans: Sequence[Span],
    n_context: int,
    page_size: int = 16,
) -> BlockSparseLayout:
    """The full causal prefix of every anchor (the peers' context)."""
    return build_relaxed_layout(anchors, None, RelaxedContextSpec(chunk_spans, n_context, 1.0, page_size, mode="full"))
