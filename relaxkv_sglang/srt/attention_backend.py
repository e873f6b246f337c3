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
(through :func:`active_fold`); without a fold every request is the ordinary
contiguous case. Decode is inherited unchanged from ``torch_native``.

SGLang file touched: ``sglang/srt/layers/attention/torch_native_backend.py``
(subclassed; its constructor and ``forward_decode`` are reused).
"""

from __future__ import annotations

import dataclasses

import torch

from relaxkv_sglang.core.attention import scoped_causal_attention
from relaxkv_sglang.srt import forward as fold_state


@dataclasses.dataclass
class ExtendRows:
    """One request's rows in an extend batch.

    Attributes:
        req_pool_idx: the request's row in ``req_to_token``.
        row_start: first row of this request in the batch's q/k/v.
        positions: int64 [n_rows] absolute position of each row.
        scope_start: int64 [n_rows] first key position each row may attend to.
    """

    req_pool_idx: int
    row_start: int
    positions: torch.Tensor
    scope_start: torch.Tensor

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])


def contiguous_rows(forward_batch) -> list[ExtendRows]:
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


def build_backend_class():
    """The backend class, built lazily so this module imports without sglang."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class RelaxKVAttnBackend(TorchNativeAttnBackend):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            self.extend_rows: list[ExtendRows] | None = None

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self.extend_rows = None
            if forward_batch.forward_mode.is_extend():
                fold = fold_state.active_fold()
                self.extend_rows = fold.extend_rows() if fold is not None else contiguous_rows(forward_batch)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.is_cross_attention or self.extend_rows is None:
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
            for rows in self.extend_rows:
                r = slice(rows.row_start, rows.row_start + rows.n_rows)
                o[r] = scoped_causal_attention(q_[r], k_cache, v_cache, rows.positions, rows.scope_start,
                                               req_to_token[rows.req_pool_idx], scale=layer.scaling)
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    return RelaxKVAttnBackend
