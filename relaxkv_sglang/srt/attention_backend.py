"""The ``relaxkv`` attention backend: extend rows at explicit positions and scopes.

SGLang's backends assume each request's extend tokens are the contiguous tail of its sequence.
A batch the fold changed breaks that: it keeps only some rows, each at its own position, and a
row of a chunk computed position-independently (a chunk-cache miss) may see only keys from its
*scope start* on:

* an ordinary extend row: scope start 0, keys ``[0, position]``;
* a row of a chunk-cache miss: scope start = the chunk's first position, so the chunk attends
  only to itself.

Which rows a folded batch carries comes from :mod:`relaxkv_sglang.srt.forward` (through
:func:`~relaxkv_sglang.srt.context.forward_context`). :func:`attention_path` decides, per batch,
who attends (a pure function, unit-tested on fake batch descriptions):

* ``"sglang"``: decode, idle, ordinary extend (no fold context, or a fold that left every
  request's contiguous tail unchanged) and every CUDA-graph capture or replay: SGLang's own
  backend, unchanged;
* ``"scoped"``: an extend batch the fold changed, or one whose repair query pass records the
  query's scores: the plugin's scoped attention. (A repair's anchors never reach the backend:
  the model hook runs them in :mod:`.layer_loop` after SGLang's layers.)

Two classes, chosen by :func:`create_backend` from the model runner's device:

* CPU (:func:`build_backend_class`): a subclass of ``torch_native``; ``"scoped"`` batches attend
  through :func:`~relaxkv_sglang.core.attention.scoped_causal_attention` (every extend batch goes
  there, as before: the torch path is unchanged), decode is ``torch_native``'s.
* CUDA (:func:`build_cuda_backend_class`): SGLang's FlashInfer backend (a subclass, so its
  decode, extend, CUDA-graph state and capture hooks are its own, untouched); only ``"scoped"``
  batches take :class:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferScopedPrefill` (one
  FlashInfer paged prefill per layer, each chunk its own causal segment, planned once per
  forward), and such batches, and any whose context carries a repair, are kept off prefill CUDA
  graphs (:func:`may_replay_graph`).
  **Not yet run on a GPU** (docs/gpu.md).

Both refuse at startup a model whose attention layers use a setting the plugin's attention does not
apply (a sliding window, a logit soft cap, FP8 K/V scales: :func:`check_attention_settings`).

SGLang files touched: ``sglang/srt/layers/attention/torch_native_backend.py`` and
``flashinfer_backend.py`` (subclassed; constructors, decode and graph hooks reused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from relaxkv_sglang.core.attention import scoped_causal_attention
from relaxkv_sglang.core.repair_plan import RepairCost
from relaxkv_sglang.gpu.prefill_inputs import ScopedPrefillInputs, scoped_prefill_inputs
from relaxkv_sglang.srt.context import ExtendRows, ForwardContext, forward_context, record_query_scores
from relaxkv_sglang.srt.failures import InvariantError
from relaxkv_sglang.srt.layer_loop import AnchorAttention

SGLANG, SCOPED = "sglang", "scoped"

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


def rows_are_contiguous_tails(rows: Sequence[ExtendRows], prefix_lens: Sequence[int],
                              extend_lens: Sequence[int]) -> bool:
    """Whether the fold's rows are exactly the batch's ordinary rows: request i's tail
    ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])`` in batch order, scope start 0."""
    if len(rows) != len(prefix_lens) or len(rows) != len(extend_lens):
        return False
    start = 0
    for r, pre, n in zip(rows, prefix_lens, extend_lens):
        if r.row_start != start or r.n_rows != n:
            return False
        if n and not (torch.equal(r.positions, torch.arange(pre, pre + n, dtype=r.positions.dtype))
                      and not bool(r.scope_start.any())):
            return False
        start += n
    return True


def attention_path(is_extend: bool, context: Optional[ForwardContext], ordinary_rows: Callable[[], bool]) -> str:
    """Who attends a batch (module doc): ``"sglang"`` or ``"scoped"``.

    Args:
        is_extend: the batch is an extend (prefill) batch (``ForwardMode.is_extend``).
        context: the fold's decision attached for this forward (None: SGLang's own batch; every
            decode batch and every CUDA-graph capture has none).
        ordinary_rows: evaluated only when nothing else decides: whether the folded rows are
            every request's contiguous tail with scope 0 (:func:`rows_are_contiguous_tails`).
    Returns:
        ``"scoped"`` when the backend must record the query's scores (``records_scores``) or
        the rows are not the ordinary tails; else ``"sglang"``.
    """
    if context is None or not is_extend:
        return SGLANG
    if getattr(context, "records_scores", False):
        return SCOPED
    return SGLANG if ordinary_rows() else SCOPED


def may_replay_graph(path: str, context: Optional[ForwardContext]) -> bool:
    """Whether a batch may replay SGLang's prefill CUDA graph: only SGLang's own batches, and never
    one whose context carries a repair. A graph holds SGLang's kernels, and its replay swaps the
    decoder stack's ``forward`` for the captured body (an instance attribute that shadows the
    plugin's class-level model hook), so a repair would silently not run."""
    return path == SGLANG and getattr(context, "repair", None) is None


def unsupported_settings(model: Any) -> list[str]:
    """What the plugin's attention (scoped rows and anchors, on either device) does not apply, per
    attention layer of ``model`` (SGLang's ``RadixAttention`` modules): a sliding window, a logit
    soft cap, K/V scales (an FP8 KV cache with scales). Empty when every layer is plain causal."""
    found = []
    for module in model.modules() if model is not None else ():
        if not (hasattr(module, "sliding_window_size") and hasattr(module, "layer_id")):
            continue
        where = f"layer {module.layer_id}"
        if module.sliding_window_size not in (None, -1):
            found.append(f"{where}: a sliding window of {module.sliding_window_size} tokens")
        if getattr(module, "logit_cap", 0):
            found.append(f"{where}: a logit soft cap of {module.logit_cap}")
        for kind in ("k", "v"):
            scale = getattr(module, f"{kind}_scale_float", None)
            if scale not in (None, 1.0):
                found.append(f"{where}: a {kind.upper()} scale of {scale}")
    return found


def check_attention_settings(model: Any) -> None:
    """Refuse, in one line, a model whose attention layers use a setting the plugin's attention
    does not apply (:func:`unsupported_settings`): its scoped rows and anchors would attend
    without it, silently wrong."""
    found = unsupported_settings(model)
    if found:
        more = f" (and {len(found) - 2} more)" if len(found) > 2 else ""
        raise RuntimeError(f"relaxkv: the relaxkv attention backend does not apply {'; '.join(found[:2])}{more}; "
                           "serve this model with another --attention-backend and without the relaxkv tree cache")


def batch_path(backend: Any, forward_batch: "ForwardBatch") -> str:
    """:func:`attention_path` of a live ``ForwardBatch`` on the backend it runs on."""
    context = forward_context(backend)
    return attention_path(
        forward_batch.forward_mode.is_extend(), context,
        lambda: rows_are_contiguous_tails(context.extend_rows, forward_batch.extend_prefix_lens_cpu,
                                          forward_batch.extend_seq_lens_cpu))


def scoped_inputs(rows: Sequence[ExtendRows]) -> ScopedPrefillInputs:
    """The fold's rows (batch order) as one paged-prefill call's segments."""
    start = 0
    for r in rows:
        if r.row_start != start:
            raise InvariantError("relaxkv: the fold's rows do not tile the batch")
        start += r.n_rows
    req = torch.cat([torch.full((r.n_rows,), r.req_pool_idx, dtype=torch.int64) for r in rows])
    return scoped_prefill_inputs(req, torch.cat([r.positions for r in rows]), torch.cat([r.scope_start for r in rows]))


def create_backend(model_runner: Any) -> Any:
    """The ``relaxkv`` backend for a model runner: FlashInfer-composed on CUDA, torch elsewhere."""
    if str(model_runner.device).split(":")[0] == "cuda":
        return build_cuda_backend_class()(model_runner)
    return build_backend_class()(model_runner)


def _plugin_state(backend: Any, model_runner: Any) -> None:
    """What both classes carry for the rest of the plugin (after refusing a model whose attention
    settings it would drop)."""
    check_attention_settings(getattr(model_runner, "model", None))
    backend.anchor_attention = AnchorAttention()  # the repair pass's anchors (layer_loop)
    # The model's repair cost model, for relaxkv_budget (decided once, read per repair).
    backend.repair_cost = RepairCost.from_hf_config(model_runner.model_config.hf_config.to_dict(),
                                                    str(model_runner.device).split(":")[0])


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
            _plugin_state(self, model_runner)

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
            extend_rows = self.extend_rows(forward_batch)
            for rows in extend_rows:
                r = slice(rows.row_start, rows.row_start + rows.n_rows)
                o[r] = scoped_causal_attention(q_[r], k_cache, v_cache, rows.positions, rows.scope_start,
                                               req_to_token[rows.req_pool_idx], scale=layer.scaling)
            record_query_scores(extend_rows, q_, k_cache, layer.scaling)  # a repair's query pass
            return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    return RelaxKVAttnBackend


def build_cuda_backend_class() -> type:
    """The CUDA class: SGLang's FlashInfer backend plus the plugin's scoped batches (module doc)."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from relaxkv_sglang.gpu.flashinfer_attention import FlashInferScopedPrefill

    class RelaxKVFlashInferBackend(FlashInferAttnBackend):
        """SGLang's FlashInfer backend; batches the fold changed take the plugin's path."""

        def __init__(self, model_runner: Any) -> None:
            super().__init__(model_runner)
            _plugin_state(self, model_runner)
            # SGLang's FlashInfer workspace, shared (stream-ordered runs): nothing allocated here
            # that the KV pool's sizing did not leave room for
            self.anchor_attention = AnchorAttention(float_workspace=self.workspace_buffer)
            self._scoped = FlashInferScopedPrefill(model_runner.device, float_workspace=self.workspace_buffer)
            self._scoped_batch: Any = None
            self._path: tuple[Any, Any, str] = (None, None, SGLANG)

        def path(self, forward_batch: "ForwardBatch") -> str:
            """:func:`batch_path`, computed once per (batch, context)."""
            context = forward_context(self)
            if self._path[0] is not forward_batch or self._path[1] is not context:
                self._path = (forward_batch, context, batch_path(self, forward_batch))
            return self._path[2]

        def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
            """SGLang's planning for its own batches; none for the plugin's."""
            if self.path(forward_batch) == SGLANG:
                return super().init_forward_metadata(forward_batch)
            # The plugin's batch: SGLang's wrappers are not planned (the scoped call is planned at
            # its first layer).
            self.forward_metadata = None
            self._scoped_batch = None

        def can_run_prefill_cuda_graph(self, forward_batch: "ForwardBatch") -> bool:
            """:func:`may_replay_graph`: SGLang's own batches without a repair."""
            return may_replay_graph(self.path(forward_batch), forward_context(self))

        def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                           forward_batch: "ForwardBatch", save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
            """SGLang's FlashInfer extend, or, for a batch the fold changed, write the rows' K/V and
            attend each scope run causally (one FlashInfer call, planned at the first layer)."""
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
                self._scoped.plan(scoped_inputs(forward_context(self).extend_rows), self.req_to_token_pool.req_to_token,
                                  num_qo_heads=layer.tp_q_head_num, num_kv_heads=k_cache.shape[1],
                                  head_dim=layer.qk_head_dim, dtype=q_.dtype, kv_dtype=k_cache.dtype,
                                  scale=layer.scaling)
                self._scoped_batch = forward_batch
            o = self._scoped.run(q_, k_cache, v_cache)
            record_query_scores(forward_context(self).extend_rows, q_, k_cache, layer.scaling)  # a repair's query pass
            return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    return RelaxKVFlashInferBackend
