"""The ``relaxkv`` attention backend's CPU class: SGLang's ``torch_native`` with extend rows at explicit positions
and scopes (:mod:`.attention_backend` says which batches and why).

SGLang file touched: ``sglang/srt/layers/attention/torch_native_backend.py`` (subclassed; its
constructor and decode reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from relaxkv_sglang.attention.causal import scoped_causal_attention
from relaxkv_sglang.attention.extend_rows import ExtendRows, record_query_scores
from relaxkv_sglang.attention.sglang.anchor_attention import AnchorAttention
from relaxkv_sglang.attention.sglang.attention_paths import check_attention_settings, contiguous_rows, folded_rows

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


class RelaxKVAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with extend rows at explicit positions and scopes (module doc)."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__(model_runner)
        self._rows_batch: Optional[ForwardBatch] = None
        self._rows: list[ExtendRows] = []
        check_attention_settings(getattr(model_runner, "model", None))
        self.anchor_attention = AnchorAttention()  # the repair's anchors (RepairServices)

    def extend_rows(self, forward_batch: "ForwardBatch") -> list[ExtendRows]:
        """The batch's rows (the fold's, or each request's tail), read once per batch at the first layer: SGLang
        plans the backend in ``ForwardBatch.init_new``, before the fold's context is attached."""
        if self._rows_batch is not forward_batch:
            folded = folded_rows(self)
            self._rows = folded.extend_rows if folded is not None else contiguous_rows(forward_batch)
            self._rows_batch = forward_batch
        return self._rows

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                       forward_batch: "ForwardBatch", save_kv_cache: bool = True) -> torch.Tensor:
        """Write the rows' K/V, then attend each row from its scope start to its position."""
        if layer.is_cross_attention:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        extend_rows = self.extend_rows(forward_batch)
        for rows in extend_rows:
            r = slice(rows.row_start, rows.row_start + rows.n_rows)
            o[r] = scoped_causal_attention(q_[r], k_cache, v_cache, rows.positions, rows.scope_start,
                                           req_to_token[rows.req_pool_idx], scale=layer.scaling)
        record_query_scores(extend_rows, q_, k_cache, layer.scaling)  # a repair's query pass
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)
