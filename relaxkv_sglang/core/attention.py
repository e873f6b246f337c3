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

from relaxkv_sglang.core.staging import HostStage, Staged, to_device

__all__ = [
    "AttentionWork",
    "dense_causal_attention",
    "gathered_attention",
    "scoped_causal_attention",
    "block_sparse_attention",
    "masked_attention",
    "ScopedCausalPlan",
    "BlockSparsePlan",
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

    def add(self, visible: int, executed: int, full: int) -> None:
        """Count one call's pairs."""
        self.visible += visible
        self.executed += executed
        self.full += full

    def add_layout(self, layout) -> None:
        """Count one layout by its own methods (an executor that does not count as it runs)."""
        self.visible += layout.kv_pairs()
        self.executed += executed_kv_pairs(layout)
        self.full += layout.full_kv_pairs()


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


class ScopedCausalPlan:
    """:func:`scoped_causal_attention` decided on the host: rows sharing a scope start form a
    group that gathers its key range once.

    Decide once (``__init__``, host tensors), run at every layer (:meth:`run`): the groups' row
    indices and positions travel on ``stage`` (one copy for everything the stage carries), each
    group's key positions are made on the device, and no run reads the device back.

    Args:
        q_pos: int64 host [n] row positions; scope_start: int64 host [n] (scope_start <= q_pos).
        stage: where the index tensors go (its ``send`` before the first :meth:`run`).
    """

    def __init__(self, q_pos: torch.Tensor, scope_start: torch.Tensor, stage: HostStage) -> None:
        self.n_rows = int(q_pos.shape[0])
        self.groups: list[tuple[Staged, Staged, int, int, bool]] = []  # (rows, positions, scope, end, sees a key)
        for scope in torch.unique(scope_start).tolist():
            sel = (scope_start == scope).nonzero().flatten()
            pos = q_pos[sel]
            self.groups.append((stage.put(sel), stage.put(pos), scope, int(pos.max()) + 1, bool((pos >= scope).all())))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor,
            scale: Optional[float] = None) -> torch.Tensor:
        """q [n, n_heads, d]; k/v [n_k, n_kv_heads, d] (e.g. a KV pool); key_rows int [>= max(q_pos) + 1]
        row of k/v holding the key at each position, on k's device -> [n, n_heads, dv] in q's dtype."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for rows, pos, scope, end, sees_a_key in self.groups:
            at = rows.get()
            key_pos = torch.arange(scope, end, dtype=torch.int64, device=key_rows.device)
            out[at] = gathered_attention(q.index_select(0, at), k, v, pos.get(), key_idx=key_rows[key_pos],
                                         key_pos=key_pos, scale=scale, every_row_sees_a_key=sees_a_key)
        return out


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
    sharing a scope start gather their key range once (:class:`ScopedCausalPlan`, planned and
    run in one call; a caller running the same rows at many layers keeps the plan).

    Args:
        q: [n, n_heads, d]; k/v: [n_k, n_kv_heads, d] (e.g. a KV pool).
        q_pos: int64 [n] row positions; scope_start: int64 [n] (scope_start <= q_pos), on the
            host (given on a device they are read back first: a host sync).
        key_rows: int [>= max(q_pos) + 1] row of k/v holding the key at each position
            (e.g. a request's ``req_to_token`` row), on k's device.
        scale: softmax scale, default ``d ** -0.5``.
    Returns:
        [n, n_heads, dv] in q's dtype.
    """
    stage = HostStage(q.device)
    plan = ScopedCausalPlan(q_pos.cpu(), scope_start.cpu(), stage)
    stage.send()
    return plan.run(q, k, v, key_rows, scale)


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
    """Execute a ``BlockSparseLayout`` (see layout.py): :class:`BlockSparsePlan`, planned and run
    in one call (a caller running many layouts of one pass plans them together, on one stage).

    The key pages a row block lists are expanded to token rows, K/V rows are gathered, and its
    queries attend to them with the layout's intra-block causal rule (key position <= query
    position; keys are stored in prompt order, so the key position is the row index).

    Args:
        q: [layout.n_rows, n_heads, d] queries of the layout's rows, in row order
            (``layout.q_pos`` gives their positions).
        k: [n_k >= layout.n_keys, n_kv_heads, d]; v: [n_k, n_kv_heads, dv] prompt-ordered KV.
        layout: BlockSparseLayout (host tensors).
        scale: softmax scale, default ``d ** -0.5``.
        return_lse: also return the LSE (each row block its own call).
        key_rows: int64 [>= layout.n_keys], the row of k/v holding the key at each prompt
            position (e.g. a request's KV-pool slots), on k's device; default: position j is row j.
        work: when given, the layout's pairs are added to it.
    Returns:
        out [n_rows, n_heads, dv], and lse float32 [n_rows, n_heads] if return_lse.
        Work = ``layout.kv_pairs()`` visible pairs (+ the masked part of grouped pages).
    
    Example (a full causal layout equals dense causal attention on its rows):

    >>> import torch
    >>> from relaxkv_sglang.core.layout import build_relaxed_layout
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(n, h, 8, generator=g) for n, h in ((3, 2), (32, 1), (32, 1)))
    >>> rows = torch.tensor([9, 17, 30])
    >>> layout = build_relaxed_layout(rows, None, [(4, 32)], 32, 1.0, page_size=8, mode="full")
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
    plan = BlockSparsePlan(layout, stage, per_block=return_lse)
    stage.send()
    return plan.run(q, k, v, _default_scale(q, scale), key_rows, work, return_lse)


GROUP_ROWS = 128  # at most this many rows per fused call of the CPU executor (unless one block has more)
# a fused call's fixed cost on a CPU, in (row, key) pairs of attention
# (why 4096: docs/experiments/INDEX.md#group-call-pairs)
GROUP_CALL_PAIRS = 4096


class BlockSparsePlan:
    """A layout's execution decided on the host: groups of row blocks, each one fused call.

    Consecutive row blocks are grouped (:func:`_block_groups`, by cost; ``per_block``: each block
    alone, as the LSE needs); a group gathers the K/V of the *union* of its blocks' pages and each
    row is masked to its own block's pages and causality. Each group's key positions and mask go
    on ``stage`` (one copy for everything it carries), so :meth:`run` neither reads the device nor
    copies to it. The work executed is ``sum(group rows x union keys)`` (:func:`executed_kv_pairs`).

    Args:
        layout: BlockSparseLayout (host tensors).
        stage: where the index tensors go (its ``send`` before :meth:`run`).
        per_block: one group per row block.
    """

    def __init__(self, layout, stage: HostStage, per_block: bool = False) -> None:
        self.n_rows = layout.n_rows
        self.full_pairs = layout.full_kv_pairs()
        self.visible_pairs = self.executed_pairs = 0
        self.groups: list[tuple[int, int, Staged, Staged]] = []  # (first row, end row, key positions, visible)
        ps = layout.page_size
        row_indptr, indptr = layout.row_indptr.tolist(), layout.indptr.tolist()
        entry_block = layout.block_of_entry()
        indices, rows_of_block = layout.indices.long(), layout.row_indptr.long().diff()
        groups = ([(b, b + 1) for b in range(layout.n_row_blocks)] if per_block
                  else _block_groups(layout, entry_block))
        for b0, b1 in groups:
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
            self.visible_pairs += int(torch.count_nonzero(visible))
            self.executed_pairs += visible.numel()
            self.groups.append((r0, r1, stage.put(key_pos), stage.put(visible)))

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            key_rows: Optional[torch.Tensor] = None, work: Optional[AttentionWork] = None, return_lse: bool = False):
        """q [n_rows, H, d] in row order; k/v [n_k, Hkv, d]; key_rows int64 [>= n_keys] on k's device
        (None: position j is row j) -> out [n_rows, H, dv] (q's dtype; 0 for a row that sees no
        key), and lse float32 [n_rows, H] with ``return_lse`` (-inf for such a row)."""
        if q.shape[0] != self.n_rows:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {self.n_rows}")
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
                out[r0:r1] = _sdpa(q[r0:r1], kg, vg, visible.get(), scale)
        return (out, lse) if return_lse else out


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
