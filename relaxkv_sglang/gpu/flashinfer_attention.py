"""Anchor attention over a relaxed context on a GPU, through FlashInfer: the thin layer.

Every decision is made in torch by the core, shared with the CPU path:
:func:`~relaxkv_sglang.core.layout.build_relaxed_layout` says which keys each
anchor sees. :func:`~relaxkv_sglang.gpu.variable_block.to_flashinfer_variable_block`
(plain torch) splits that layout into FlashInfer's two calls. This module only
hands those tensors to FlashInfer and merges the results:

1. ``flashinfer.sparse.VariableBlockSparseAttentionWrapper`` (non-causal): each
   row block attends to the pages lying entirely before its first row. Only the
   listed pages are read: the wrapper expands them into page-size-1 indices of a
   paged prefill, so the work follows the context ratio (no mask over dense
   attention).
2. ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` with page size 1 (SGLang's
   KV pool layout), one query per request, non-causal: each row attends to its
   visible keys (``j <= t``) on the partially visible pages, read straight from
   the pool slots.
3. The two partial results are merged by their log-sum-exp.

Decide once, run many times: :meth:`FlashInferRelaxedAttention.plan` per layer
layout, :meth:`FlashInferRelaxedAttention.run` per call.
``python -m relaxkv_sglang.gpu.check`` compares this layer with
:func:`~relaxkv_sglang.core.attention.block_sparse_attention`.

Pinned to flashinfer-python 0.7.2 (the version sglang 0.5.23 requires); another
version is refused at construction, since the wrappers' signatures move between
releases.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from relaxkv_sglang.core.layout import BlockSparseLayout
from relaxkv_sglang.gpu.variable_block import merge_attention_states, to_flashinfer_variable_block

FLASHINFER_VERSION = "0.7.2"
WORKSPACE_BYTES = 128 * 1024 * 1024
# FlashInfer reports log-sum-exp in base 2; the merge takes natural logs.
_LN2 = math.log(2.0)


def import_flashinfer():
    """The pinned ``flashinfer`` module, or a RuntimeError saying what is wrong."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"relaxkv: the GPU anchor attention needs flashinfer-python=={FLASHINFER_VERSION} "
                           f"({exc})") from exc
    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise RuntimeError(f"relaxkv: flashinfer {flashinfer.__version__} is installed; this layer is written "
                           f"for {FLASHINFER_VERSION} (relaxkv_sglang/gpu/flashinfer_attention.py)")
    return flashinfer


class FlashInferRelaxedAttention:
    """Executes a :class:`~relaxkv_sglang.core.layout.BlockSparseLayout` with FlashInfer.

    Args:
        device: the CUDA device of the KV pool.
        workspace_bytes: float workspace of each of the two wrappers.
    """

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES):
        flashinfer = import_flashinfer()
        self.device = torch.device(device)
        self._blocks = flashinfer.sparse.VariableBlockSparseAttentionWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device))
        self._diag = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device), kv_layout="NHD")
        self._planned: Optional[dict] = None

    def plan(self, layout: BlockSparseLayout, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, scale: Optional[float] = None, key_rows: Optional[torch.Tensor] = None) -> None:
        """Prepare both FlashInfer calls for one layout.

        Args:
            layout: the anchors' layout (rows = anchors in position order).
            num_qo_heads, num_kv_heads, head_dim: attention shape (GQA when they differ).
            dtype: q/k/v dtype, float16 or bfloat16.
            scale: softmax scale, default ``head_dim ** -0.5``.
            key_rows: int64 [>= layout.n_keys], the KV-pool slot of the key at each prompt
                position (default: position j is slot j).
        """
        fi = to_flashinfer_variable_block(layout, num_kv_heads)
        dev = self.device
        scale = head_dim ** -0.5 if scale is None else scale
        if key_rows is None:
            key_rows = torch.arange(layout.n_keys)
        key_rows = key_rows.to(dev, torch.int64)
        n_rows = layout.n_rows
        self._diag.plan(
            torch.arange(n_rows + 1, dtype=torch.int32, device=dev),
            fi.diag_kv_indptr.to(dev),
            key_rows[fi.diag_kv_indices.to(dev).long()].to(torch.int32),
            torch.ones(n_rows, dtype=torch.int32, device=dev),
            num_qo_heads, num_kv_heads, head_dim, 1,
            causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        any_block = bool(fi.block_mask_map.any())
        if any_block:  # the wrapper cannot plan an all-empty map
            self._blocks.plan(
                fi.block_mask_map.to(dev), fi.block_row_sz.to(dev), fi.block_col_sz.to(dev),
                num_qo_heads, num_kv_heads, head_dim,
                causal=False, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        rows_with_block = torch.repeat_interleave(fi.block_mask_map[0].any(-1), fi.block_row_sz[0].long())
        self._planned = {
            "n_rows": n_rows,
            "any_block": any_block,
            "rows_with_block": rows_with_block.to(dev),
            "key_slots": key_rows[:layout.n_keys],
        }

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attend the planned layout.

        Args:
            q: [n_rows, num_qo_heads, head_dim] the anchors' queries, in layout row order.
            k_cache, v_cache: [n_slots, num_kv_heads, head_dim] the KV pool of the layer.
        Returns:
            [n_rows, num_qo_heads, head_dim] in q's dtype.
        """
        p = self._planned
        if p is None:
            raise RuntimeError("FlashInferRelaxedAttention.run before plan")
        if q.shape[0] != p["n_rows"]:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {p['n_rows']}")
        # [n_slots, page_size=1, num_kv_heads, head_dim]: the pool as FlashInfer's NHD paged cache.
        out_d, lse_d = self._diag.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)), return_lse=True)
        if not p["any_block"]:
            return out_d
        # The block part reads the request's keys in prompt order, HND.
        k = k_cache.index_select(0, p["key_slots"]).transpose(0, 1).contiguous()
        v = v_cache.index_select(0, p["key_slots"]).transpose(0, 1).contiguous()
        out_b, lse_b = self._blocks.run(q.transpose(0, 1).contiguous(), k, v, return_lse=True)
        out_b, lse_b = out_b.transpose(0, 1), lse_b.transpose(0, 1).float()
        # Rows of a block with no fully visible page attended to nothing in that call.
        lse_b = torch.where(p["rows_with_block"][:, None], lse_b * _LN2, float("-inf"))
        out, _ = merge_attention_states(out_b, lse_b, out_d, lse_d.float() * _LN2)
        return out
