"""The ``relaxkv`` attention backend: extend rows at explicit positions and scopes.

SGLang's ``torch_native`` backend assumes each request's extend tokens are the
contiguous tail of its sequence, and it recomputes attention for the whole
sequence (prefix rows included) before discarding the prefix rows. This
backend instead attends only for the rows actually in the batch, each at its
own position, and lets a row see only keys from its *scope start* on:

* an ordinary extend row: scope start 0, keys ``[0, position]``;
* a row of a chunk computed position-independently (a chunk-cache miss): scope
  start = the chunk's first position, so the chunk attends only to itself.

Which rows a folded batch carries comes from :mod:`relaxkv_sglang.srt.forward`
(through :func:`~relaxkv_sglang.srt.context.forward_context`); without a fold every request is the ordinary
contiguous case. Decode is inherited unchanged from ``torch_native``.

SGLang file touched: ``sglang/srt/layers/attention/torch_native_backend.py``
(subclassed; its constructor and ``forward_decode`` are reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from relaxkv_sglang.core.attention import scoped_causal_attention
from relaxkv_sglang.core.repair_plan import RepairCost
from relaxkv_sglang.srt.context import ExtendRows, forward_context
from relaxkv_sglang.srt.layer_loop import AnchorAttention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def contiguous_rows(forward_batch: "ForwardBatch") -> list[ExtendRows]:
    """Rows of an ordinary extend batch: each request's tail, scope start 0."""
    rows, start = [], 0
    pool_idx = forward_batch.req_pool_indices.tolist()
    prefix = forward_batch.extend_prefix_lens_cpu
    lens = forward_batch.extend_seq_lens_cpu
    for rp, pre, n in zip(pool_idx, prefix, lens):
        pos = torch.arange(pre, pre + n, dtype=torch.int64)
        rows.append(ExtendRows(rp, start, pos, torch.zeros(n, dtype=torch.int64)))
        start += n
    return rows


def build_backend_class() -> type:
    """The backend class, built lazily so this module imports without sglang."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class RelaxKVAttnBackend(TorchNativeAttnBackend):
        """``torch_native`` with extend rows at explicit positions and scopes (module doc)."""

        def __init__(self, model_runner: Any) -> None:
            super().__init__(model_runner)
            self._rows_batch: Any = None
            self._rows: list[ExtendRows] = []
            self.anchor_attention = AnchorAttention()  # the repair pass's anchors (layer_loop)
            # The model's repair cost model, for relaxkv_budget (decided once, read per repair).
            self.repair_cost = RepairCost.from_hf_config(model_runner.model_config.hf_config.to_dict(),
                                                         str(model_runner.device).split(":")[0])

        def extend_rows(self, forward_batch: "ForwardBatch") -> list[ExtendRows]:
            """The batch's rows: the fold's, or each request's contiguous tail (read once per batch).

            Read at the first layer, not in ``init_forward_metadata``: SGLang plans the backend
            inside ``ForwardBatch.init_new``, before the fold's context is attached to the batch.
            """
            if self._rows_batch is not forward_batch:
                context = forward_context(self)
                self._rows = context.extend_rows if context is not None else contiguous_rows(forward_batch)
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
            for rows in self.extend_rows(forward_batch):
                r = slice(rows.row_start, rows.row_start + rows.n_rows)
                o[r] = scoped_causal_attention(q_[r], k_cache, v_cache, rows.positions, rows.scope_start,
                                               req_to_token[rows.req_pool_idx], scale=layer.scaling)
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    return RelaxKVAttnBackend
