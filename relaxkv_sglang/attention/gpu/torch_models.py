"""Torch model of the one FlashInfer 0.7.2 call the GPU path makes, for checks on a CPU.

:func:`paged_prefill_attention` is ``BatchPrefillWithPagedKVCacheWrapper`` with page size 1 (page ``i``
is pool slot ``i``), with its ``plan`` + ``run`` convention: request ``r`` has the queries
``qo_indptr[r]:qo_indptr[r+1]`` and keys ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``; causal is
bottom-right aligned (``include/flashinfer/attention/prefill.cuh``). FlashInfer reads
``clamp(n_pages - 1, 0) * page_size + last_page_len`` keys, not the indptr's (:func:`keys_read`), so a
segment listing no page still reads past its end; the model applies that rule and refuses such a call.
Its LSE is natural-log (FlashInfer's base 2). The tests, :mod:`.cuda_rules` and the check's dry run put
it in FlashInfer's place (:func:`flashinfer_stand_in`, with FlashInfer's argument checks) and compare
with the torch executors. Not on the serving path.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from relaxkv_sglang.attention.causal import masked_attention
from relaxkv_sglang.attention.gpu.cuda_rules import device_kernel

__all__ = ["keys_read", "paged_prefill_attention", "paged_prefill_mask", "PagedPrefillWrapperModel",
           "flashinfer_stand_in"]


def keys_read(kv_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int = 1) -> torch.Tensor:
    """int64 [n_seg] from kv_indptr int [n_seg + 1] and last_page_len int [n_seg]; ValueError past the
    segment's pages (it would read the next segment's keys)."""
    pages = kv_indptr.long().diff()
    n = (pages - 1).clamp(min=0) * page_size + last_page_len.long()
    over = (n > pages * page_size).nonzero().flatten()
    if over.numel():
        s = int(over[0])
        raise ValueError(f"FlashInfer would read {int(n[s])} keys of segment {s}, which lists {int(pages[s])} pages")
    return n


def paged_prefill_mask(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                       n_slots: int, causal: bool = True) -> torch.Tensor:
    """bool [n_q, n_slots]: the slots each query reads (for tests)."""
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
    last_page_len: Optional[torch.Tensor] = None,
):
    """q [n_q, H, d]; k_cache, v_cache [n_slots, H_kv, d | dv]; qo_indptr, kv_indptr int [n_req + 1];
    kv_indices int [kv_indptr[-1]]; last_page_len int [n_req] (None: every listed key) -> out [n_q, H,
    dv] (0: sees no key), lse float32 [n_q, H] (-inf). Requests padded to the longest lists."""
    qo_indptr, kv_indptr, kv_indices = qo_indptr.long(), kv_indptr.long(), kv_indices.long()
    n_req = qo_indptr.numel() - 1
    qo_len = qo_indptr.diff()
    kv_len = kv_indptr.diff() if last_page_len is None else keys_read(kv_indptr, last_page_len)
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


class PagedPrefillWrapperModel:
    """The wrapper (page size 1, causal, NHD, fa2) as :func:`paged_prefill_attention`, with FlashInfer's
    checks: host int32 indptrs at ``plan``, the planned shapes at ``run``."""

    created = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str, backend: str = "auto") -> None:
        if kv_layout != "NHD" or backend != "fa2":
            raise ValueError(f"the plugin plans NHD / fa2, got {kv_layout} / {backend}")
        type(self).created += 1
        self.args: Optional[tuple] = None
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             *, causal, q_data_type, kv_data_type, sm_scale=None, o_data_type=None) -> None:
        if page_size != 1 or not causal:
            raise ValueError("the plugin plans page size 1, causal")
        for x in (qo_indptr, kv_indptr, last_page_len):
            if x.device.type != "cpu" or x.dtype != torch.int32:
                raise ValueError(f"indptr / last_page_len must be host int32, got {x.device} {x.dtype}")
        if last_page_len.numel() != qo_indptr.numel() - 1:
            raise ValueError("one last_page_len per segment")
        if kv_indices.dtype != torch.int32 or kv_indices.numel() != int(kv_indptr[-1]):
            raise ValueError("kv_indices: int32, kv_indptr[-1] of them")
        self.args = (qo_indptr, kv_indptr, kv_indices, sm_scale, last_page_len)
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [n_qo, H, d]; paged_kv_cache ([pages, 1, Hkv, d], [pages, 1, Hkv, dv]) -> [n_qo, H, dv]."""
        k_cache, v_cache = paged_kv_cache
        qo_indptr, kv_indptr, kv_indices, scale, last_page_len = self.args
        if k_cache.dim() != 4 or k_cache.shape[1] != 1 or q.shape[0] != int(qo_indptr[-1]):
            raise ValueError("run: an NHD page-size-1 cache and the planned queries")
        if not (q.shape[1], k_cache.shape[2], q.shape[2]) == self.heads == (q.shape[1], v_cache.shape[2],
                                                                            k_cache.shape[3]):
            raise ValueError(f"run: heads {tuple(q.shape[1:])} / {tuple(k_cache.shape[2:])}, planned {self.heads}")
        return device_kernel(paged_prefill_attention)(q, k_cache[:, 0], v_cache[:, 0], qo_indptr, kv_indptr, kv_indices,
                                                      scale=scale, last_page_len=last_page_len)


def flashinfer_stand_in(version: str) -> types.ModuleType:
    """For ``sys.modules["flashinfer"]``."""
    module = types.ModuleType("flashinfer")
    module.__version__ = version
    module.BatchPrefillWithPagedKVCacheWrapper = PagedPrefillWrapperModel
    return module
