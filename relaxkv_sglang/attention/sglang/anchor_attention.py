"""The repair's anchors attend: the executor a worker keeps, and one request's plan of a pass.

:class:`AnchorAttention` executes a layer's block-sparse layout (the core's
:class:`~relaxkv_sglang.attention.layout.BlockSparseLayout`): FlashInfer on a CUDA pool in half
precision (:mod:`relaxkv_sglang.attention.gpu.flashinfer_attention`), the torch executor
(:class:`~relaxkv_sglang.attention.block_sparse.BlockSparseGroups`) otherwise. Decide once, run per layer:
:meth:`AnchorAttention.plan` takes every layer's layout of a request when its pass is planned
(host work; the index tensors on the pass's :class:`~relaxkv_sglang.attention.staging.HostStage`), and
the returned :class:`PreparedAnchors` runs one layer at a time (:mod:`.layer_loop`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from relaxkv_sglang.attention.block_sparse import AttentionWork, BlockSparseGroups
from relaxkv_sglang.attention.layout import BlockSparseLayout
from relaxkv_sglang.attention.staging import HostStage


class AnchorAttention:
    """The anchors' block-sparse attention over a layer's KV pool, one executor per worker.

    FlashInfer on a GPU in half precision (:mod:`relaxkv_sglang.attention.gpu.flashinfer_attention`; its
    wrappers and workspace are built on first use and kept), the torch executor
    (:class:`~relaxkv_sglang.attention.block_sparse.BlockSparseGroups`) otherwise. Both execute the same
    layout; ``python -m relaxkv_sglang.gpu_check`` compares them. Decide once, run per layer:
    :meth:`plan` takes every layer's layout of a request when its pass is planned (host work, the
    index tensors on the pass's stage); the plan then runs one layer at a time. The ``relaxkv``
    attention backend owns the worker's instance.

    Args:
        float_workspace: FlashInfer's float workspace to share (the CUDA backend hands SGLang's).
    """

    def __init__(self, float_workspace: Optional[torch.Tensor] = None) -> None:
        self._flashinfer: Any = None  # FlashInferAnchorAttention, once a GPU pool is seen
        self._float_workspace = float_workspace  # SGLang's FlashInfer workspace, on a GPU

    @staticmethod
    def uses_flashinfer(device: torch.device, dtype: torch.dtype) -> bool:
        """FlashInfer runs on a CUDA pool in half precision; anything else takes the torch executor."""
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def plan(self, layouts: list[BlockSparseLayout], stage: HostStage, dtype: torch.dtype) -> "PreparedAnchors":
        """Every layer's anchors of one request (``layouts``, host), for a pool of ``dtype`` on
        ``stage.device``; the index tensors go on ``stage`` (its ``send`` before the first run)."""
        if self.uses_flashinfer(stage.device, dtype):
            if self._flashinfer is None:
                from relaxkv_sglang.attention.gpu.flashinfer_attention import FlashInferAnchorAttention

                self._flashinfer = FlashInferAnchorAttention(stage.device, float_workspace=self._float_workspace)
            return PreparedAnchors(flashinfer=self._flashinfer, flashinfer_metadata=self._flashinfer.pass_metadata(layouts, stage))
        return PreparedAnchors(torch_groups=[BlockSparseGroups(layout, stage) for layout in layouts])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BlockSparseLayout,
                 scale: float, key_rows: torch.Tensor, work: Optional[AttentionWork] = None) -> torch.Tensor:
        """One layout decided in the layer (the ``layout_at`` ablation), planned and run at once:
        q [n_rows, H, d] in ``layout.q_pos`` order, the layer's pool [pool_size, Hkv, d], key_rows
        int64 [>= layout.n_keys] on the pool's device -> [n_rows, H, dv]."""
        stage = HostStage(k_cache.device)
        plan = self.plan([layout], stage, k_cache.dtype)
        stage.send()
        return plan.run(0, q, k_cache, v_cache, key_rows, scale, work)


class PreparedAnchors:
    """One request's anchors in one pass, planned (:meth:`AnchorAttention.plan`): the torch
    executor's plan of every layer, or FlashInfer's executor and its forward plan."""

    def __init__(self, torch_groups: Optional[list[BlockSparseGroups]] = None, flashinfer: Any = None,
                 flashinfer_metadata: Any = None) -> None:
        self.torch_groups, self.flashinfer, self.flashinfer_metadata = torch_groups, flashinfer, flashinfer_metadata

    def run(self, l: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_rows: torch.Tensor,
            scale: float, work: Optional[AttentionWork] = None) -> torch.Tensor:
        """Layer l's anchors: q [n_rows, H, d] in layout row order, k_cache/v_cache [pool_size, Hkv, d],
        key_rows int64 on the pool's device -> [n_rows, H, dv]; the layout's pairs added to ``work``
        (FlashInfer's executed pairs: each segment's padded queries times its keys)."""
        if self.torch_groups is not None:
            return self.torch_groups[l].run(q, k_cache, v_cache, scale, key_rows, work)
        if work is not None:
            layout = self.flashinfer_metadata.layouts[l]
            work.add(layout.kv_pairs(), self.flashinfer_metadata.layers[l].inputs.executed_pairs, layout.full_kv_pairs())
        return self.flashinfer.run(self.flashinfer_metadata, l, q, k_cache, v_cache, key_rows, scale)
