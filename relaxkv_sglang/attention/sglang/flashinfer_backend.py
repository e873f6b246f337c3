"""The ``relaxkv`` attention backend's CUDA class: SGLang's FlashInfer backend, the fold's batches through the
plugin's scoped FlashInfer prefill (:mod:`.attention_backend` says which batches and why; docs/gpu.md).

SGLang file touched: ``sglang/srt/layers/attention/flashinfer_backend.py`` (subclassed; its
constructor, workspace, decode, extend and CUDA-graph hooks reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from relaxkv_sglang.attention.gpu.flashinfer_attention import FlashInferScopedPrefill
from relaxkv_sglang.attention.sglang.attention_paths import (
    SCOPED,
    SGLANG,
    batch_path,
    check_attention_settings,
    folded_rows,
    may_replay_graph,
    scoped_inputs,
)
from relaxkv_sglang.attention.extend_rows import record_query_scores
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.runtime.failures import InvariantError

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from relaxkv_sglang.attention.extend_rows import FoldedRows


class RelaxKVFlashInferBackend(FlashInferAttnBackend):
    """SGLang's FlashInfer backend; batches the fold changed take the plugin's path."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__(model_runner)
        check_attention_settings(getattr(model_runner, "model", None))
        # SGLang's FlashInfer float workspace, shared (stream-ordered runs): the plugin allocates none
        self.anchor_attention = AnchorAttention(self.workspace_buffer)  # the repair's anchors (RepairServices)
        self._scoped = FlashInferScopedPrefill(model_runner.device, float_workspace=self.workspace_buffer)
        self._scoped_batch: Optional[ForwardBatch] = None
        self._path: tuple[Optional[ForwardBatch], Optional[FoldedRows], str] = (None, None, SGLANG)

    def path(self, forward_batch: "ForwardBatch") -> str:
        """:func:`batch_path`, computed once per (batch, folded rows)."""
        rows = folded_rows(self)
        if self._path[0] is not forward_batch or self._path[1] is not rows:
            self._path = (forward_batch, rows, batch_path(self, forward_batch))
        return self._path[2]

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """SGLang's planning for its own batches; none for the plugin's."""
        if self.path(forward_batch) == SGLANG:
            return super().init_forward_metadata(forward_batch)
        # the plugin's batch: SGLang's wrappers unplanned (the scoped call plans at its first layer)
        self.forward_metadata = None
        self._scoped_batch = None

    def can_run_prefill_cuda_graph(self, forward_batch: "ForwardBatch") -> bool:
        """:func:`may_replay_graph`: SGLang's own batches without a repair."""
        return may_replay_graph(self.path(forward_batch), folded_rows(self))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        """SGLang's extend, or for a folded batch write the rows' K/V and attend each scope run (planned at layer 0)."""
        path = self.path(forward_batch)
        if path == SGLANG:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if path != SCOPED or layer.is_cross_attention:
            raise InvariantError(f"relaxkv: no attention for a {path} batch at layer {layer.layer_id}")
        if save_kv_cache and k is not None and v is not None:
            # the batch's physical mark travels with its locs (a unified pool refuses unmarked ones)
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self._scoped_batch is not forward_batch:  # once per forward: the segments are per batch
            self._scoped.plan(scoped_inputs(folded_rows(self).extend_rows), self.req_to_token_pool.req_to_token,
                              num_qo_heads=layer.tp_q_head_num, num_kv_heads=k_cache.shape[1],
                              head_dim=layer.qk_head_dim, dtype=q_.dtype, kv_dtype=k_cache.dtype,
                              scale=layer.scaling)
            self._scoped_batch = forward_batch
        o = self._scoped.run(q_, k_cache, v_cache)
        record_query_scores(folded_rows(self).extend_rows, q_, k_cache, layer.scaling)  # a repair's query pass
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
