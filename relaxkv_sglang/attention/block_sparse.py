"""The CPU executor of a :class:`~relaxkv_sglang.attention.layout.BlockSparseLayout`: row blocks grouped.

A group of consecutive row blocks gathers the K/V of the *union* of its blocks' pages once and runs one
fused attention call (:mod:`~relaxkv_sglang.attention.causal`'s SDPA, or its masked einsum when the LSE
is needed), each row masked to its own block's pages and causality. Grouping trades masked work for
calls: block ``b`` joins the open group when ``(R + r_b) * |U ∪ P_b| <= R * |U| + r_b * |P_b| +
GROUP_CALL_PAIRS / page_size`` (in pages; ``R``, ``U``: the group's rows and page union; ``r_b``,
``P_b``: the block's), within ``GROUP_ROWS`` rows. Work executed: ``sum(group rows x union keys)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from relaxkv_sglang.attention.causal import masked_attention, sdpa_attention, softmax_scale
from relaxkv_sglang.attention.staging import HostStage, Staged

__all__ = [
    "AttentionWork",
    "block_sparse_attention",
    "BlockSparseGroups",
    "executed_kv_pairs",
    "GROUP_ROWS",
    "GROUP_CALL_PAIRS",
]


@dataclass
class AttentionWork:
    """(row, key) pairs counted as the executor runs (a report needs no second pass): ``visible``
    (``kv_pairs``), ``executed`` (masked ones included), ``full`` (``full_kv_pairs``)."""

    visible: int = 0
    executed: int = 0
    full: int = 0

    def add(self, visible: int, executed: int, full: int) -> None:
        self.visible += visible
        self.executed += executed
        self.full += full


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout,
    scale: Optional[float] = None,
    return_lse: bool = False,
    key_rows: Optional[torch.Tensor] = None,
    work: Optional[AttentionWork] = None,
):
    """:class:`BlockSparseGroups` planned and run. q [layout.n_rows, H, d] in row order; k [n_k >= n_keys,
    Hkv, d], v [n_k, Hkv, dv] in prompt order; a host layout; key_rows int64 [>= n_keys] on k's device,
    each position's k/v row (pool slots; None: row j) -> out [n_rows, H, dv], lse float32 [n_rows, H]
    with ``return_lse`` (one call per block). A full causal layout equals dense causal attention:

    >>> import torch
    >>> from relaxkv_sglang.attention.layout import RelaxedContextSpec, build_relaxed_layout
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((3, 2), (32, 1), (32, 1)))
    >>> rows = torch.tensor([9, 17, 30])
    >>> layout = build_relaxed_layout(rows, None, RelaxedContextSpec([(4, 32)], 32, page_size=8, mode="full"))
    >>> out = block_sparse_attention(q, k, v, layout)
    >>> mask = torch.arange(32)[None, :] <= rows[:, None]  # [rows, keys] causal
    >>> w = torch.einsum("rhd,khd->rhk", q, k.expand(-1, 2, -1)) * 8 ** -0.5
    >>> dense = torch.einsum("rhk,khd->rhd", w.masked_fill(~mask[:, None], -torch.inf).softmax(-1), v.expand(-1, 2, -1))
    >>> out.shape, torch.allclose(out, dense, atol=1e-5)
    (torch.Size([3, 2, 8]), True)
    """
    if q.shape[0] != layout.n_rows:
        raise ValueError(f"q has {q.shape[0]} rows, layout has {layout.n_rows}")
    stage = HostStage(q.device)
    groups = BlockSparseGroups(layout, stage, per_block=return_lse)
    stage.send()
    return groups.run(q, k, v, softmax_scale(q, scale), key_rows, work, return_lse)


GROUP_ROWS = 128  # rows per fused call (unless one block has more)
GROUP_CALL_PAIRS = 4096  # a call's fixed cost on a CPU in (row, key) pairs (docs/experiments/INDEX.md#group-call-pairs)


class BlockSparseGroups:
    """A layout's groups (``per_block``: each alone, for the LSE) decided on the host; indices go on
    ``stage`` (sent before :meth:`run`), so :meth:`run` neither reads the device nor copies to it."""

    def __init__(self, layout, stage: HostStage, per_block: bool = False) -> None:
        self.n_rows = layout.n_rows
        self.full_pairs = layout.full_kv_pairs()
        self.visible_pairs = self.executed_pairs = 0
        self.groups: list[tuple[int, int, Staged, Staged]] = []  # (first row, end row, key positions, visible)
        ps = layout.page_size
        row_indptr, indptr = layout.row_indptr.tolist(), layout.indptr.tolist()
        entry_block = layout.block_of_entry()
        indices, rows_of_block = layout.indices.long(), layout.row_indptr.long().diff()
        q_pos = layout.q_pos.long()
        block_of_row = torch.repeat_interleave(torch.arange(layout.n_row_blocks), rows_of_block)
        groups = ([(b, b + 1) for b in range(layout.n_row_blocks)] if per_block
                  else _block_groups(layout, entry_block))
        for b0, b1 in groups:
            r0, r1 = row_indptr[b0], row_indptr[b1]
            e0, e1 = indptr[b0], indptr[b1]
            if r1 == r0 or e1 == e0:
                continue
            union, page_of_entry = torch.unique(indices[e0:e1], return_inverse=True)
            member = torch.zeros(b1 - b0, union.numel(), dtype=torch.bool)
            member[entry_block[e0:e1] - b0, page_of_entry] = True
            # Keys ascend with the sorted pages, so the ones past n_keys (the last page's tail) end the list.
            key_pos = (union[:, None] * ps + torch.arange(ps)[None, :]).flatten()
            n_in = int(torch.searchsorted(key_pos, layout.n_keys))
            key_pos = key_pos[:n_in]
            # Pages to keys once per block, then each row takes its block's: [blocks, keys] -> [rows, keys].
            block_keys = member[:, :, None].expand(-1, -1, ps).reshape(b1 - b0, -1)[:, :n_in]
            visible = block_keys.index_select(0, block_of_row[r0:r1] - b0)
            rows_pos = q_pos[r0:r1]
            # Causality masks only the keys after the group's first row (the keys ascend).
            j0 = int(torch.searchsorted(key_pos, rows_pos.min(), right=True))
            if j0 < n_in:
                visible[:, j0:] &= key_pos[None, j0:] <= rows_pos[:, None]
            self.visible_pairs += int(torch.count_nonzero(visible))
            self.executed_pairs += visible.numel()
            self.groups.append((r0, r1, stage.put(key_pos), stage.put(visible)))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            key_rows: Optional[torch.Tensor] = None, work: Optional[AttentionWork] = None, return_lse: bool = False):
        """As :func:`block_sparse_attention`; out in q's dtype, 0 (lse -inf) for a row that sees no key."""
        if q.shape[0] != self.n_rows:
            raise ValueError(f"q has {q.shape[0]} rows, the groups hold {self.n_rows}")
        if work is not None:
            work.visible += self.visible_pairs
            work.executed += self.executed_pairs
            work.full += self.full_pairs
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = (torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
               if return_lse else None)
        for r0, r1, key_pos, visible in self.groups:
            slots = key_pos.get() if key_rows is None else key_rows[key_pos.get()]
            kg, vg = k.index_select(0, slots), v.index_select(0, slots)
            if return_lse:
                o, s = masked_attention(q[None, r0:r1], kg[None], vg[None], visible.get()[None], scale)
                out[r0:r1], lse[r0:r1] = o[0], s[0]
            else:
                out[r0:r1] = sdpa_attention(q[r0:r1], kg, vg, visible.get(), scale)
        return (out, lse) if return_lse else out


def _page_sets(layout, entry_block: torch.Tensor) -> list[int]:
    """Each row block's pages as an int bitset (62-bit words, one pass): grouping costs a few int ops."""
    n_blocks, word = layout.n_row_blocks, 62
    n_words = layout.n_pages // word + 1
    pages = layout.indices.long()
    bits = torch.zeros(n_blocks * n_words, dtype=torch.int64)
    # Pages are distinct within a block, so adding the bits is OR-ing them.
    bits.index_add_(0, entry_block * n_words + pages // word, torch.ones_like(pages) << (pages % word))
    sets = []
    for words in bits.view(n_blocks, n_words).tolist():
        value = 0
        for w in reversed(words):
            value = (value << word) | w
        sets.append(value)
    return sets


def _block_groups(layout, entry_block: Optional[torch.Tensor] = None) -> list[tuple[int, int]]:
    """(first, end) row-block ranges, greedy (module doc), in whole pages. Consecutive anchors share most
    pages (own chunk, ranking, sink), so they group; an anchor far later opens a new group."""
    n_blocks = layout.n_row_blocks
    if n_blocks == 0:
        return []
    rows = layout.row_indptr.long().diff().tolist()
    sets = _page_sets(layout, layout.block_of_entry() if entry_block is None else entry_block)
    call_pages = GROUP_CALL_PAIRS / layout.page_size
    groups, first, union, n_rows = [], 0, sets[0], rows[0]
    for b in range(1, n_blocks):
        joined = union | sets[b]
        together = (n_rows + rows[b]) * joined.bit_count()
        apart = n_rows * union.bit_count() + rows[b] * sets[b].bit_count() + call_pages
        if together <= apart and n_rows + rows[b] <= GROUP_ROWS:
            union, n_rows = joined, n_rows + rows[b]
        else:
            groups.append((first, b))
            first, union, n_rows = b, sets[b], rows[b]
    groups.append((first, n_blocks))
    return groups


def executed_kv_pairs(layout) -> int:
    """Masked ones included: each group's rows times its page union's keys."""
    if layout.nnz == 0:
        return 0
    entry_block = layout.block_of_entry()
    groups = _block_groups(layout, entry_block)
    group_of_block = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([b1 - b0 for b0, b1 in groups]))
    P = layout.n_pages
    union = torch.unique(group_of_block[entry_block] * P + layout.indices.long())  # (group, page) pairs
    group, page = union // P, union % P
    keys = torch.zeros(len(groups), dtype=torch.long).index_add_(
        0, group, (layout.n_keys - page * layout.page_size).clamp(max=layout.page_size))
    row_indptr = layout.row_indptr.tolist()
    rows = torch.tensor([row_indptr[b1] - row_indptr[b0] for b0, b1 in groups])
    return int((keys * rows).sum())
