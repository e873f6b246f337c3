"""A block-sparse layout as FlashInfer's two calls, and the merge of their results (plain torch).

The core's :class:`~relaxkv_sglang.core.layout.BlockSparseLayout` says which keys each anchor
sees; this module maps it onto FlashInfer 0.7.2's kernels without importing FlashInfer (the
thin layer that calls them is :mod:`.flashinfer_attention`).

``VariableBlockSparseAttentionWrapper.plan(block_mask_map, block_row_sz, block_col_sz,
num_qo_heads, num_kv_heads, head_dim, causal=False, ...)`` takes an HND ``q`` of the rows
``[n_heads, n_rows, d]`` and ``k, v = K[:n_keys].transpose(0, 1)`` ``[n_kv_heads, n_keys, d]``:

* ``block_row_sz[h, r]`` = rows in row block r (``diff(row_indptr)``), same for every kv head;
* ``block_col_sz[h, c]`` = ``page_size`` (the last page clipped): column blocks are pages;
* ``block_mask_map[h, r, c]`` = page c is listed for row block r **and** lies entirely before
  the block's first row (fully visible to all its rows, so no mask is needed);
* that wrapper has no position-wise causal mask, so each row's visible keys on partially
  visible pages (the diagonal page) go to a second, ragged call: ``diag_kv_indptr``
  [n_rows+1] / ``diag_kv_indices`` [nnz] list, per row, the key tokens ``j <= t`` of those
  pages.  That is a FlashInfer paged prefill with page_size 1 (SGLang's KV pool layout), one
  query per request, ``causal=False``;
* the two partial results are merged with their LSEs (:func:`merge_attention_states`,
  FlashInfer's ``merge_state``).  :mod:`.torch_models` reproduces both calls in torch, and the
  tests check the merge equals ``core.attention.block_sparse_attention`` on the layout.

``python -m relaxkv_sglang.gpu.check --time-split`` times the split for one request (CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaxkv_sglang.core.layout import BlockSparseLayout

__all__ = [
    "FlashInferVariableBlockPlan",
    "to_flashinfer_variable_block",
    "merge_attention_states",
]


@dataclass
class FlashInferVariableBlockPlan:
    """Arguments for FlashInfer's variable block-sparse call plus the ragged diagonal call.

    Attributes:
        block_mask_map: bool [n_kv_heads, n_row_blocks, n_pages] fully visible pages.
        block_row_sz: int32 [n_kv_heads, n_row_blocks] rows per block (sum = n_rows).
        block_col_sz: int32 [n_kv_heads, n_pages] tokens per page (sum = n_keys).
        diag_kv_indptr: int32 [n_rows + 1] per-row offsets into diag_kv_indices.
        diag_kv_indices: int32 [nnz_diag] key tokens of partially visible pages, j <= t.
        q_pos: int64 [n_rows] row positions (order of q's rows in both calls).
    """

    block_mask_map: torch.Tensor
    block_row_sz: torch.Tensor
    block_col_sz: torch.Tensor
    diag_kv_indptr: torch.Tensor
    diag_kv_indices: torch.Tensor
    q_pos: torch.Tensor


def _starts(lengths: torch.Tensor) -> torch.Tensor:
    """int64 offset of each segment of ``lengths`` laid end to end."""
    return torch.cumsum(lengths, 0) - lengths


def to_flashinfer_variable_block(layout: BlockSparseLayout, num_kv_heads: int) -> FlashInferVariableBlockPlan:
    """Split a layout into FlashInfer's non-causal variable-block call + a ragged diagonal call.

    See the module doc.  A listed page goes to the block-sparse part when its last token is <
    the block's first (smallest) row position (fully visible to every row); otherwise its keys
    ``j <= t`` go to the ragged part of each row t.  A row's own page is never fully visible, so
    when the layout lists it (relaxed and full layouts always do) the row's ragged part holds at
    least the row itself and no row reaches the ragged kernel with zero keys.  Pages entirely after a row add nothing to it.  Both parts together are exactly the
    layout's visible pairs.  A few torch ops over all rows and pages, no per-row loop.

    Args:
        layout: BlockSparseLayout (rows of its row blocks covering ``[0, n_rows)``).
        num_kv_heads: kv heads (FlashInfer takes the same pattern per kv head).
    Returns:
        FlashInferVariableBlockPlan.
    """
    P, ps, R, n_keys = layout.n_pages, layout.page_size, layout.n_row_blocks, layout.n_keys
    page_start = torch.arange(P) * ps
    col_sz = ((page_start + ps).clamp(max=n_keys) - page_start).to(torch.int32)
    row_sz = (layout.row_indptr[1:] - layout.row_indptr[:-1]).to(torch.int32)
    rows_per_block = row_sz.long()
    q_pos = layout.q_pos.long()
    block_of_row = torch.repeat_interleave(rows_per_block)  # [n_rows]
    first = torch.full((R,), torch.iinfo(torch.int64).max, dtype=torch.long)
    first.scatter_reduce_(0, block_of_row, q_pos, "amin")

    # One entry per listed (row block, page) of the CSR.
    pages = layout.indices.long()
    block_of_entry = torch.repeat_interleave((layout.indptr[1:] - layout.indptr[:-1]).long())
    last_of_entry = ((pages + 1) * ps).clamp(max=n_keys) - 1
    partial = last_of_entry >= first.index_select(0, block_of_entry)
    full = ~partial & (rows_per_block > 0).index_select(0, block_of_entry)
    mask = torch.zeros(R * P, dtype=torch.bool)
    mask[block_of_entry * P + pages] = full  # (block, page) entries are distinct
    mask = mask.view(R, P)

    # Partial entries, grouped by block in CSR order; then one pair per (row, partial page of
    # its block), row-major, pages in listed order.
    partial_entry = partial.nonzero().squeeze(1)
    n_partial = torch.zeros(R, dtype=torch.long).index_add_(0, block_of_entry, partial.long())
    pairs_of_row = n_partial.index_select(0, block_of_row)
    pair_row = torch.repeat_interleave(pairs_of_row)
    # pair i of row r takes partial entry  _starts(n_partial)[block(r)] + (i - _starts(pairs_of_row)[r]).
    rank_shift = (_starts(n_partial).index_select(0, block_of_row) - _starts(pairs_of_row)).index_select(0, pair_row)
    pair_page = pages.index_select(0, partial_entry.index_select(0, rank_shift + torch.arange(pair_row.numel())))
    pair_start = pair_page * ps
    # Keys j <= t of the page: from its first token to min(t, its last token).
    pair_last = torch.minimum(q_pos.index_select(0, pair_row), (pair_start + ps).clamp(max=n_keys) - 1)
    pair_len = (pair_last - pair_start + 1).clamp(min=0)
    # Key i of the ragged list is token  pair_start[p] + (i - _starts(pair_len)[p])  of its pair p.
    key_shift = (pair_start - _starts(pair_len)).repeat_interleave(pair_len)
    diag_indices = (key_shift + torch.arange(key_shift.numel())).to(torch.int32)
    row_len = torch.zeros(layout.n_rows, dtype=torch.long).index_add_(0, pair_row, pair_len)
    diag_indptr = torch.zeros(layout.n_rows + 1, dtype=torch.int32)
    diag_indptr[1:] = torch.cumsum(row_len, 0).to(torch.int32)

    def per_head(x: torch.Tensor) -> torch.Tensor:
        return x[None].expand(num_kv_heads, *x.shape).contiguous()

    return FlashInferVariableBlockPlan(
        block_mask_map=per_head(mask),
        block_row_sz=per_head(row_sz),
        block_col_sz=per_head(col_sz),
        diag_kv_indptr=diag_indptr,
        diag_kv_indices=diag_indices,
        q_pos=layout.q_pos.clone(),
    )


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    Args:
        out_a, out_b: [n, H, dv]; lse_a, lse_b: float32 [n, H] (natural log, -inf = empty).
    Returns:
        (out [n, H, dv] in out_a's dtype, lse float32 [n, H]).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.where(torch.isinf(lse_a), torch.zeros_like(lse_a), torch.exp(lse_a - safe))
    wb = torch.where(torch.isinf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - safe))
    out = out_a.float() * wa[..., None] + out_b.float() * wb[..., None]
    return out.to(out_a.dtype), lse

