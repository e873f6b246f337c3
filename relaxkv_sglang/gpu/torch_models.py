"""Torch model of the one FlashInfer 0.7.2 call the GPU path makes, for checks on a CPU.

:func:`paged_prefill_attention` is ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with page
size 1 (SGLang's KV pool: page ``i`` is pool slot ``i``), same argument convention as its
``plan`` + ``run``: request ``r`` has the queries ``qo_indptr[r]:qo_indptr[r+1]`` and the keys
``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``; with ``causal=True`` query ``i`` of a request with
``qo_len`` queries and ``kv_len`` keys sees keys ``0 .. i + kv_len - qo_len`` (FlashInfer's
bottom-right alignment, ``include/flashinfer/attention/prefill.cuh``).  It returns the natural-log
LSE of :mod:`relaxkv_sglang.core.attention` (FlashInfer reports base 2).  The tests feed it to
:mod:`.flashinfer_attention` in place of FlashInfer and compare with the torch executors
(``core.attention.block_sparse_attention``, ``scoped_causal_attention``).  Not on the serving path.
"""

from __future__ import annotations

from typing import Optional

import torch

from relaxkv_sglang.core.attention import masked_attention

__all__ = ["paged_prefill_attention", "paged_prefill_mask"]


def paged_prefill_mask(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       n_slots: int, causal: bool = True) -> torch.Tensor:
    """bool [n_q, n_slots]: which pool slot each query of the call reads (for tests).

    Args: as :func:`paged_prefill_attention` (``n_slots``: pool size).
    """
    qo_indptr, kv_indptr, kv_indices = qo_indptr.long(), kv_indptr.long(), kv_indices.long()
    n_q = int(qo_indptr[-1])
    mask = torch.zeros(n_q, n_slots, dtype=torch.bool)
    qo_len, kv_len = qo_indptr.diff(), kv_indptr.diff()
    req = torch.repeat_interleave(torch.arange(qo_len.numel()), qo_len)
    i = torch.arange(n_q) - qo_indptr[:-1][req]
    n_seen = (i + 1 + kv_len[req] - qo_len[req]) if causal else kv_len[req]
    n_seen = n_seen.clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(n_q), n_seen)
    k = torch.arange(int(n_seen.sum())) - (torch.cumsum(n_seen, 0) - n_seen)[rows]
    mask[rows, kv_indices[kv_indptr[:-1][req][rows] + k]] = True
    return mask


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Torch model of FlashInfer's batch prefill over a page-size-1 paged KV cache.

    Args:
        q: [n_q, n_heads, d] (``n_q = qo_indptr[-1]``); k_cache/v_cache: [n_slots, n_kv_heads, d|dv].
        qo_indptr, kv_indptr: int [n_req + 1]; kv_indices: int [kv_indptr[-1]] pool slots.
        causal: FlashInfer's bottom-right causal rule (module doc); else every listed key.
        scale: softmax scale, default ``d ** -0.5``.
    Returns:
        out [n_q, n_heads, dv] (0 for a query that sees no key), and lse float32 [n_q, n_heads]
        (natural log, -inf for such a query) if return_lse.  Cost: requests padded to the
        longest query and key lists.
    """
    qo_indptr, kv_indptr, kv_indices = qo_indptr.long(), kv_indptr.long(), kv_indices.long()
    n_req = qo_indptr.numel() - 1
    qo_len, kv_len = qo_indptr.diff(), kv_indptr.diff()
    n_q, H = q.shape[0], q.shape[1]
    if n_req == 0 or n_q == 0:
        out = q.new_zeros(n_q, H, v_cache.shape[-1])
        lse = torch.full((n_q, H), float("-inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    wq, wk = int(qo_len.max()), max(int(kv_len.max()), 1)
    qi = torch.arange(wq)
    ki = torch.arange(wk)
    q_valid = qi[None, :] < qo_len[:, None]  # [n_req, wq]
    k_valid = ki[None, :] < kv_len[:, None]  # [n_req, wk]
    q_rows = (qo_indptr[:-1, None] + qi[None, :]).clamp(max=n_q - 1)
    k_flat = (kv_indptr[:-1, None] + ki[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
    slots = kv_indices[k_flat] if kv_indices.numel() else torch.zeros_like(k_flat)
    visible = q_valid[:, :, None] & k_valid[:, None, :]
    if causal:
        visible &= ki[None, None, :] <= (qi[None, :, None] + (kv_len - qo_len)[:, None, None])
    out_b, lse_b = masked_attention(q[q_rows], k_cache[slots], v_cache[slots], visible, scale)
    out = q.new_zeros(n_q, H, v_cache.shape[-1])
    lse = torch.full((n_q, H), float("-inf"), dtype=torch.float32, device=q.device)
    out[q_rows[q_valid]] = out_b[q_valid]
    lse[q_rows[q_valid]] = lse_b[q_valid]
    return (out, lse) if return_lse else out
