"""Torch attention over gathered KV and block-sparse layouts.

This is the numerical reference every accelerated executor must match.  All
functions take token-major tensors ``[tokens, heads, head_dim]`` (SGLang's layout), support
GQA (query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``, as HF's ``repeat_kv``),
compute the softmax in float32 and return outputs in the query dtype.  The LSE they return is
the natural log of the softmax denominator, float32 ``[n_q, n_heads]``; ``-inf`` for a query
that sees no key (its output is then 0).  Kernels that report log2 LSEs must be converted.

Work scales with the gathered key set: the sparse functions index K/V rows first and then run
dense attention on the small set; masks are applied only inside that set (causality on the
diagonal, padding of ragged rows), never over the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "AttentionWork",
    "dense_causal_attention",
    "gathered_attention",
    "scoped_causal_attention",
    "block_sparse_attention",
    "masked_attention",
    "to_device",
]


@dataclass
class AttentionWork:
    """(row, key) pairs of the layouts an executor ran, summed over its calls.

    Attributes:
        visible: pairs the layouts let a row see (``BlockSparseLayout.kv_pairs``).
        executed: pairs the executor computed, masked ones included (:func:`executed_kv_pairs`
            for the CPU executor).
        full: pairs the same rows would see with their full causal prefix
            (``BlockSparseLayout.full_kv_pairs``).
    The CPU executor counts as it runs, so a report needs no second pass over the layouts.
    """

    visible: int = 0
    executed: int = 0
    full: int = 0

    def add_layout(self, layout) -> None:
        """Count one layout by its own methods (an executor that does not count as it runs)."""
        self.visible += layout.kv_pairs()
        self.executed += executed_kv_pairs(layout)
        self.full += layout.full_kv_pairs()


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory without blocking (a plain
    copy from pageable memory synchronizes the stream: a host sync)."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[n, n_kv, d] -> [n, n_heads, d] by repeating each kv head over its query group."""
    n_kv = x.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
    return x if n_kv == n_heads else x.repeat_interleave(n_heads // n_kv, dim=1)


def _default_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: Optional[torch.Tensor],
    scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched attention under an explicit mask, with its LSE: what the other functions build on.

    Args:
        q: [B, n_q, H, d]; k: [B, n_k, H_kv, d]; v: [B, n_k, H_kv, dv].
        visible: bool [B, n_q, n_k] or None (every key visible).
        scale: softmax scale, default ``d ** -0.5``.
    Returns:
        out [B, n_q, H, dv] (q dtype; 0 for a query that sees no key) and lse float32
        [B, n_q, H] (natural log, -inf for such a query).
    """
    scale = _default_scale(q, scale)
    H = q.shape[2]
    kf = _expand_kv(k.flatten(0, 1), H).unflatten(0, k.shape[:2]).float()  # [B, n_k, H, d]
    vf = _expand_kv(v.flatten(0, 1), H).unflatten(0, v.shape[:2]).float()
    logits = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None, :, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, H, n_q]
    # A fully masked row has lse=-inf; exp(-inf - -inf) would be NaN, so zero it instead.
    probs = torch.exp(logits - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    probs = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(probs), probs)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out.to(q.dtype), lse.transpose(1, 2).contiguous()


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: Optional[torch.Tensor] = None,
    k_pos: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Dense attention with the causal rule ``k_pos <= q_pos``; the test reference.

    Args:
        q: [n_q, n_heads, d]; k: [n_k, n_kv_heads, d]; v: [n_k, n_kv_heads, dv].
        q_pos: int64 [n_q] positions of the queries, default ``n_k - n_q + arange(n_q)``
            (queries are the last n_q keys, as in prefill with a cached prefix).
        k_pos: int64 [n_k] positions of the keys, default ``arange(n_k)``.
        scale: softmax scale, default ``d ** -0.5``.
    Returns:
        out [n_q, n_heads, dv] (q dtype), and lse float32 [n_q, n_heads] if return_lse.
    """
    n_q, n_k = q.shape[0], k.shape[0]
    if k_pos is None:
        k_pos = torch.arange(n_k, device=q.device)
    if q_pos is None:
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    out, lse = masked_attention(q[None], k[None], v[None], visible[None], scale)
    return (out[0], lse[0]) if return_lse else out[0]


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    key_idx: torch.Tensor,
    key_pos: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    every_row_sees_a_key: Optional[bool] = None,
):
    """All queries attend to one gathered key set, causally by position.

    Args:
        q: [n_q, n_heads, d] queries.
        k: [n_k, n_kv_heads, d], v: [n_k, n_kv_heads, dv] the whole KV (e.g. a request's).
        q_pos: int64 [n_q] query positions.
        key_idx: int64 [n_sel] rows of k/v to gather (only these are read).
        key_pos: int64 [n_sel] positions of the gathered keys, default ``key_idx`` (KV stored
            in prompt order).
        scale: softmax scale, default ``d ** -0.5``.
        every_row_sees_a_key: whether every query sees at least one gathered key, when the caller
            knows it on the host (None: read from the mask, a host sync on a GPU).
    Returns:
        out [n_q, n_heads, dv], and lse float32 [n_q, n_heads] if return_lse.
        Cost is O(n_q * n_sel), independent of n_k.
    """
    key_idx = key_idx.to(torch.long)
    key_pos = key_idx if key_pos is None else key_pos.to(torch.long)
    kg, vg = k.index_select(0, key_idx), v.index_select(0, key_idx)
    visible = key_pos[None, :] <= q_pos.to(key_pos.device, torch.long)[:, None]
    if every_row_sees_a_key is None:
        every_row_sees_a_key = bool(visible.any(dim=1).all())
    if not return_lse and every_row_sees_a_key:
        # The serving path: torch's fused SDPA kernel on the gathered set (the
        # einsum path below materialises [H, n_q, n_sel] logits and is far slower).
        return _sdpa(q, kg, vg, visible, _default_scale(q, scale))
    out, lse = masked_attention(q[None], kg[None], vg[None], visible[None], scale)
    return (out[0], lse[0]) if return_lse else out[0]


def scoped_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scope_start: torch.Tensor,
    key_rows: torch.Tensor,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Each row attends causally to the keys from its scope start up to its own position.

    Scope start 0 is the ordinary causal prefix; a chunk's first position makes
    the chunk attend only to itself (position-independent computation). Rows
    sharing a scope start gather their key range once.

    The grouping is decided where ``q_pos`` and ``scope_start`` live: given on the host (CPU)
    beside q/k/v on a GPU, the device receives index copies only, and no host sync happens
    (every row sees at least its own key, so the fused kernel's precondition is known too).

    Args:
        q: [n, n_heads, d]; k/v: [n_k, n_kv_heads, d] (e.g. a KV pool).
        q_pos: int64 [n] row positions; scope_start: int64 [n] (scope_start <= q_pos).
        key_rows: int [>= max(q_pos) + 1] row of k/v holding the key at each position
            (e.g. a request's ``req_to_token`` row), on k's device.
        scale: softmax scale, default ``d ** -0.5``.
    Returns:
        [n, n_heads, dv] in q's dtype.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for scope in torch.unique(scope_start).tolist():
        sel = (scope_start == scope).nonzero().flatten()
        pos = q_pos[sel]
        key_pos = torch.arange(scope, int(pos.max()) + 1, dtype=torch.int64, device=key_rows.device)
        rows = to_device(sel, q.device)
        out[rows] = gathered_attention(q.index_select(0, rows), k, v, to_device(pos, key_rows.device), key_idx=key_rows[key_pos], key_pos=key_pos,
                                       scale=scale, every_row_sees_a_key=bool((pos >= scope).all()))
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n_q, H, d], k/v [n_k, H_kv, d], visible bool [n_q, n_k] (every row sees a key) -> [n_q, H, dv]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype),
        attn_mask=visible.to(q.device), scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


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
    """Execute a ``BlockSparseLayout`` (see layout.py) block by block.

    For each row block the key pages it lists are expanded to token rows, K/V rows are
    gathered, and its queries attend to them with the layout's intra-block causal rule
    (key position <= query position; keys are stored in prompt order, so the key position is
    the row index).

    Args:
        q: [layout.n_rows, n_heads, d] queries of the layout's rows, in row order
            (``layout.q_pos`` gives their positions).
        k: [n_k >= layout.n_keys, n_kv_heads, d]; v: [n_k, n_kv_heads, dv] prompt-ordered KV.
        layout: BlockSparseLayout.
        scale: softmax scale, default ``d ** -0.5``.
        key_rows: int64 [>= layout.n_keys], the row of k/v holding the key at each prompt
            position (e.g. a request's KV-pool slots); default: position j is row j.
        work: when given, the layout's pairs are added to it, counted from the masks the
            executor builds (no second pass over the layout).
    Returns:
        out [n_rows, n_heads, dv], and lse float32 [n_rows, n_heads] if return_lse.
        Work = ``layout.kv_pairs()`` visible pairs (+ the masked part of diagonal pages).
    """
    n_rows, H = q.shape[0], q.shape[1]
    if n_rows != layout.n_rows:
        raise ValueError(f"q has {n_rows} rows, layout has {layout.n_rows}")
    if work is not None:
        work.full += layout.full_kv_pairs()
    if not return_lse:
        return _block_sparse_batched(q, k, v, layout, _default_scale(q, scale), key_rows, work)
    out = q.new_zeros(n_rows, H, v.shape[-1])
    lse = torch.full((n_rows, H), float("-inf"), dtype=torch.float32, device=q.device)
    row_indptr = layout.row_indptr.tolist()
    for b in range(layout.n_row_blocks):
        r0, r1 = row_indptr[b], row_indptr[b + 1]
        if r0 == r1:
            continue
        key_idx = layout.block_key_index(b)
        if key_idx.numel() == 0:
            continue
        rows = key_idx if key_rows is None else key_rows[key_idx]
        o, s = gathered_attention(q[r0:r1], k, v, layout.q_pos[r0:r1], rows, key_idx, scale, True)
        out[r0:r1], lse[r0:r1] = o, s
        if work is not None:
            work.visible += int((key_idx[None, :] <= layout.q_pos[r0:r1, None]).sum())
            work.executed += (r1 - r0) * key_idx.numel()
    return (out, lse) if return_lse else out


GROUP_ROWS = 128  # at most this many rows per fused call of the CPU executor (unless one block has more)
# a fused call's fixed cost on a CPU, in (row, key) pairs of attention; chosen on development layouts
# (docs/experiments/2026-12-02-four-exact-cuts.md)
GROUP_CALL_PAIRS = 4096


def _block_sparse_batched(q, k, v, layout, scale: float, key_rows: Optional[torch.Tensor],
                          work: Optional[AttentionWork] = None) -> torch.Tensor:
    """Execute the layout in a few fused SDPA calls instead of one per row block.

    Consecutive row blocks are grouped (:func:`_block_groups`, by cost); a group gathers the
    K/V of the *union* of its blocks' pages and each row is masked to its own block's pages and
    causality. The work executed is ``sum(group rows x union keys)``
    (:func:`executed_kv_pairs`): blocks share a group only where that costs less than a call.
    """
    n_rows, H, _ = q.shape
    out = q.new_zeros(n_rows, H, v.shape[-1])
    ps = layout.page_size
    row_indptr, indptr = layout.row_indptr.tolist(), layout.indptr.tolist()
    entry_block = layout.block_of_entry()
    indices, rows_of_block = layout.indices.long(), layout.row_indptr.long().diff()
    for b0, b1 in _block_groups(layout, entry_block):
        r0, r1 = row_indptr[b0], row_indptr[b1]
        e0, e1 = indptr[b0], indptr[b1]
        if r1 == r0 or e1 == e0:
            continue
        union, page_of_entry = torch.unique(indices[e0:e1], return_inverse=True)  # sorted page ids
        member = torch.zeros(b1 - b0, union.numel(), dtype=torch.bool)
        member[entry_block[e0:e1] - b0, page_of_entry] = True
        key_pos = (union[:, None] * ps + torch.arange(ps)[None, :]).flatten()
        in_range = key_pos < layout.n_keys
        rows_pages = member.repeat_interleave(rows_of_block[b0:b1], dim=0)  # [rows, union pages]
        visible = rows_pages[:, :, None].expand(-1, -1, ps).reshape(r1 - r0, -1)[:, in_range]
        key_pos = key_pos[in_range]
        visible &= key_pos[None, :] <= layout.q_pos[r0:r1].long()[:, None]
        slots = key_pos if key_rows is None else key_rows[key_pos]
        if work is not None:
            work.visible += int(torch.count_nonzero(visible))
            work.executed += visible.numel()
        out[r0:r1] = _sdpa(q[r0:r1], k.index_select(0, slots), v.index_select(0, slots), visible, scale)
    return out


def _page_sets(layout, entry_block: torch.Tensor) -> list[int]:
    """Each row block's key pages as a Python int bitset (bit p set: page p listed).

    Built in one vectorised pass from 62-bit words, so grouping costs a few integer operations
    per block however many pages a block lists."""
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
    """(first, end) row-block ranges, in order, that the CPU executor runs as one call each.

    Greedy over the blocks in order: the next block joins the open group when executing it
    there (every row of the group times the union of the group's pages) costs no more than a
    call of its own (its rows times its pages, plus ``GROUP_CALL_PAIRS``), and the group stays
    within ``GROUP_ROWS`` rows. Consecutive anchors share most pages (their own chunk, the
    layer's ranking, the sink), so they group; a block that would widen the union a lot (an
    anchor far later, whose many pages the earlier rows would compute masked) opens a new one.
    Costs count whole pages (the last page's clipping is ignored)."""
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
    """(row, key) pairs the CPU executor computes for ``layout`` (masked ones included):
    each group of :func:`_block_groups` times the keys of the union of its blocks' pages."""
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
