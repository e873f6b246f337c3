"""Torch models of the two FlashInfer 0.7.2 calls the GPU path makes, for checks on a CPU.

* :func:`variable_block_sparse_reference`: ``flashinfer.sparse.VariableBlockSparseAttentionWrapper``
  (``causal=False``), same argument convention as its ``plan`` + ``run`` (HND tensors).
* :func:`ragged_attention`: ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with page size 1 and
  one query per request (SGLang's KV-pool layout).

Both return the natural-log LSE of :mod:`relaxkv_sglang.core.attention` (FlashInfer reports base
2); the tests feed them to :mod:`.flashinfer_attention` in place of FlashInfer and compare with
``core.attention.block_sparse_attention``.  Neither is on the serving path.
"""

from __future__ import annotations

from typing import Optional

import torch

from relaxkv_sglang.core.attention import masked_attention

__all__ = ["ragged_attention", "variable_block_sparse_reference"]


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Each query attends (non-causally) to its own list of key rows.

    The torch twin of a FlashInfer paged prefill with page_size 1 and one query per request
    (SGLang's KV-pool layout): query i reads ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``.

    Args:
        q: [n_q, n_heads, d]; k/v: [n_k, n_kv_heads, d|dv].
        kv_indptr: int [n_q + 1]; kv_indices: int [nnz] rows of k/v.
    Returns:
        out [n_q, n_heads, dv], and lse float32 [n_q, n_heads] if return_lse.
        Cost is O(n_q * max_row_len) (rows padded to the longest).
    """
    n_q = q.shape[0]
    kv_indptr = kv_indptr.to(torch.long)
    lens = kv_indptr[1:] - kv_indptr[:-1]
    width = int(lens.max()) if n_q else 0
    slot = torch.arange(width, device=q.device)
    valid = slot[None, :] < lens[:, None]  # [n_q, width]
    flat = (kv_indptr[:-1, None] + slot[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
    rows = kv_indices.to(torch.long)[flat] if kv_indices.numel() else torch.zeros_like(flat)
    kg, vg = k[rows], v[rows]  # [n_q, width, n_kv, d]
    out, lse = masked_attention(q[:, None], kg, vg, valid[:, None, :], scale)
    out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out


def variable_block_sparse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask_map: torch.Tensor,
    block_row_sz: torch.Tensor,
    block_col_sz: torch.Tensor,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Torch model of FlashInfer ``VariableBlockSparseAttentionWrapper`` (causal=False).

    Same argument convention as that wrapper's ``plan`` + ``run`` (HND layout):

    Args:
        q: [n_heads, qo_len, d]; k/v: [n_kv_heads, kv_len, d|dv].
        block_mask_map: bool [n_kv_heads, R, C]: row block r of kv head h attends column
            block c (all of it, no causal mask).
        block_row_sz: int [n_kv_heads, R], sums to qo_len.
        block_col_sz: int [n_kv_heads, C], sums to kv_len.
    Returns:
        out [n_heads, qo_len, dv], and lse float32 [n_heads, qo_len] if return_lse.
    """
    Hq, qo_len, _ = q.shape
    Hkv = k.shape[0]
    g = Hq // Hkv
    out = q.new_zeros(Hq, qo_len, v.shape[-1])
    lse = torch.full((Hq, qo_len), float("-inf"), dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        row_start = torch.cumsum(block_row_sz[h].long(), 0) - block_row_sz[h].long()
        col_start = torch.cumsum(block_col_sz[h].long(), 0) - block_col_sz[h].long()
        for r in range(block_row_sz.shape[1]):
            cols = block_mask_map[h, r].nonzero().squeeze(1)
            n_r = int(block_row_sz[h, r])
            if cols.numel() == 0 or n_r == 0:
                continue
            key_idx = torch.cat(
                [torch.arange(int(col_start[c]), int(col_start[c] + block_col_sz[h, c])) for c in cols.tolist()]
            )
            rs = slice(int(row_start[r]), int(row_start[r]) + n_r)
            qh = q[h * g:(h + 1) * g, rs].transpose(0, 1)  # [n_r, g, d]
            kh = k[h, key_idx][:, None]  # [n_sel, 1, d]
            vh = v[h, key_idx][:, None]
            o, s = masked_attention(qh[None], kh[None], vh[None], None, scale)
            out[h * g:(h + 1) * g, rs] = o[0].transpose(0, 1)
            lse[h * g:(h + 1) * g, rs] = s[0].transpose(0, 1)
    return (out, lse) if return_lse else out
