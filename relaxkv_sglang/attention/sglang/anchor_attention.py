"""The repair's anchors attend: the executor a worker keeps (:class:`AnchorAttention`) and one request's
planned pass (:class:`PreparedAnchors`, run one layer at a time by :mod:`~relaxkv_sglang.repair.sglang.layer_loop`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from relaxkv_sglang.attention.block_sparse import AttentionWork, BlockSparseGroups
from relaxkv_sglang.attention.layout import BlockSparseLayout
from relaxkv_sglang.attention.staging import HostStage

if TYPE_CHECKING:
    from relaxkv_sglang.attention.gpu.flashinfer_attention import AnchorPassMetadata, FlashInferAnchorAttention


class AnchorAttention:
    """The anchors' block-sparse attention over a layer's KV pool, one per worker (the backend owns it).

    FlashInfer on a CUDA pool in half precision, else ``BlockSparseGroups``; ``python -m relaxkv_sglang.gpu_check``
    compares them. ``float_workspace``: FlashInfer's, shared (the CUDA backend hands SGLang's)."""

    def __init__(self, float_workspace: Optional[torch.Tensor] = None) -> None:
        self._flashinfer: Optional[FlashInferAnchorAttention] = None  # built once a GPU pool is seen, kept
        self._float_workspace = float_workspace

    @staticmethod
    def uses_flashinfer(device: torch.device, dtype: torch.dtype) -> bool:
        """FlashInfer runs on a CUDA pool in half precision; anything else takes the torch executor."""
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def plan(self, layouts: list[BlockSparseLayout], stage: HostStage, dtype: torch.dtype) -> "PreparedAnchors":
        """One request's host ``layouts``, every layer, for a ``dtype`` pool; index tensors on ``stage``."""
        if self.uses_flashinfer(stage.device, dtype):
            if self._flashinfer is None:
                from relaxkv_sglang.attention.gpu.flashinfer_attention import FlashInferAnchorAttention

                self._flashinfer = FlashInferAnchorAttention(stage.device, float_workspace=self._float_workspace)
            return PreparedAnchors(flashinfer=self._flashinfer,
                                   flashinfer_metadata=self._flashinfer.pass_metadata(layouts, stage))
        return PreparedAnchors(torch_groups=[BlockSparseGroups(layout, stage) for layout in layouts])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: BlockSparseLayout,
                 scale: float, key_rows: torch.Tensor, work: Optional[AttentionWork] = None) -> torch.Tensor:
        """One layout decided in the layer (``layout_at`` ablation), planned and run at once: q [n_rows, H, d] in
        ``layout.q_pos`` order, pool [pool_size, Hkv, d], key_rows int64 [>= layout.n_keys] -> [n_rows, H, dv]."""
        stage = HostStage(k_cache.device)
        plan = self.plan([layout], stage, k_cache.dtype)
        stage.send()
        return plan.run(0, q, k_cache, v_cache, key_rows, scale, work)


class PreparedAnchors:
    """One request's anchors in one pass (:meth:`AnchorAttention.plan`): torch's plan per layer, or FlashInfer's."""

    def __init__(self, torch_groups: Optional[list[BlockSparseGroups]] = None,
                 flashinfer: Optional[FlashInferAnchorAttention] = None,
                 flashinfer_metadata: Optional[AnchorPassMetadata] = None) -> None:
        self.torch_groups, self.flashinfer, self.flashinfer_metadata = torch_groups, flashinfer, flashinfer_metadata

    def run(self, l: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_rows: torch.Tensor,
            scale: float, work: Optional[AttentionWork] = None) -> torch.Tensor:
        """Layer l: q [n_rows, H, d] in layout row order, pools [pool_size, Hkv, d], key_rows int64 ->
        [n_rows, H, dv]; pairs added to ``work`` (FlashInfer's executed: each segment's padded queries times
        its keys)."""
        if self.torch_groups is not None:
            return self.torch_groups[l].run(q, k_cache, v_cache, scale, key_rows, work)
        if work is not None:
            layout = self.flashinfer_metadata.layouts[l]
            work.add(layout.kv_pairs(), self.flashinfer_metadata.layers[l].inputs.executed_pairs,
                     layout.full_kv_pairs())
        return self.flashinfer.run(self.flashinfer_metadata, l, q, k_cache, v_cache, key_rows, scale)
