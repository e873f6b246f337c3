"""The plugin's attention on a GPU through FlashInfer's paged prefill: the thin layer.

Every decision is made in torch, shared with the CPU path: the core's layouts
(:func:`~relaxkv_sglang.core.layout.build_relaxed_layout`) say which keys each anchor sees, the
fold's rows (:class:`~relaxkv_sglang.srt.context.ExtendRows`) say which keys each chunk-scoped row
sees, and :mod:`.prefill_inputs` (plain torch, no FlashInfer import) turns both into segments of
one ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` call: page size 1 over SGLang's KV pool
(the keys are read straight from the pool slots, no gather), ``causal=True``, ``backend="fa2"``
(what SGLang's FlashInfer backend uses).  This module only plans and runs those calls:

* :class:`FlashInferAnchorAttention` (the repair pass's anchors): at the first anchor call of a
  request in a pass, every layer's host metadata is built in one vectorised pass
  (:func:`~.prefill_inputs.anchor_prefill_inputs`); each layer then gets one ``plan`` (host
  indptrs, keys expanded on the device: no device-to-host copy) and one ``run``.
* :class:`FlashInferScopedPrefill` (an extend batch the fold changed): one ``plan`` per forward
  (the segments are the same at every layer), one ``run`` per layer.

Host syncs: none of our own (the indptrs FlashInfer's scheduler reads on the host are computed
on the host from CPU tensors; the device only receives copies).  FlashInfer's ``plan`` stages
its schedule through a pinned buffer owned by the wrapper and copies it asynchronously, so a
wrapper must not be planned again before its previous plan reached the device. The wrappers are a
ring of at most ``RING_SIZE`` (FlashInfer allocates 8 MiB of device and 8 MiB of pinned host
memory per wrapper), reused in turn across layers, requests and passes, all sharing one float
workspace: each use records a CUDA event after its run, and a wrapper's next plan first waits for
that event (a host wait only when the ring has come round before the device finished its run).
Bound per worker: ``WORKSPACE_BYTES`` plus ``RING_SIZE`` x 16 MiB for the anchors, the same for
scoped batches, allocated at first use, after SGLang sized its KV pool (leave that room with
``--mem-fraction-static``, docs/gpu.md).

Pinned to flashinfer-python 0.7.2 (the version sglang 0.5.23 requires); another version is
refused at construction, since the wrappers' signatures move between releases.  The torch model
of the call is :func:`~relaxkv_sglang.gpu.torch_models.paged_prefill_attention` (the CPU tests);
``python -m relaxkv_sglang.gpu.check`` compares the real call with the torch executors on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from relaxkv_sglang.core.attention import to_device
from relaxkv_sglang.core.layout import BlockSparseLayout
from relaxkv_sglang.gpu.prefill_inputs import (
    AnchorLayerInputs,
    ScopedPrefillInputs,
    anchor_prefill_inputs,
)

FLASHINFER_VERSION = "0.7.2"
WORKSPACE_BYTES = 128 * 1024 * 1024
RING_SIZE = 4  # wrappers per executor (module doc)

__all__ = ["FLASHINFER_VERSION", "FlashInferAnchorAttention", "FlashInferScopedPrefill", "import_flashinfer"]


def import_flashinfer():
    """The pinned ``flashinfer`` module, or a RuntimeError saying what is wrong."""
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"relaxkv: the GPU attention path needs flashinfer-python=={FLASHINFER_VERSION} "
                           f"({exc})") from exc
    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise RuntimeError(f"relaxkv: flashinfer {flashinfer.__version__} is installed; this layer is written "
                           f"for {FLASHINFER_VERSION} (relaxkv_sglang/gpu/flashinfer_attention.py)")
    return flashinfer


def _host(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host int32 tensor FlashInfer's plan reads on the host (pinned on CUDA, for its copies)."""
    x = x.to(torch.int32)
    return x.pin_memory() if device.type == "cuda" else x


class _PagedPrefillCall:
    """One FlashInfer paged-prefill wrapper (NHD, page size 1, causal) and its current plan.

    ``new_event``: makes the event recorded after each run (CUDA); None on other devices."""

    def __init__(self, flashinfer: Any, float_workspace: torch.Tensor,
                 new_event: Optional[Callable[[], Any]] = None) -> None:
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace, "NHD", backend="fa2")
        self.n_qo = -1
        self.kv_indices: Optional[torch.Tensor] = None  # kept alive until the run
        self.new_event = new_event
        self.last_run: Any = None  # the event after the last run, until the next plan

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
             scale: float) -> None:
        """qo_indptr/kv_indptr: int32 host [n_seg + 1]; kv_indices: int32 [n_kv] pool slots on the device;
        dtype/kv_dtype: of q and of the KV pool."""
        if self.last_run is not None:  # the previous plan's staged copy, and its run, are done
            if not self.last_run.query():  # a host wait only when the device is behind
                self.last_run.synchronize()
            self.last_run = None
        dev = kv_indices.device
        self.kv_indices = kv_indices
        self.n_qo = int(qo_indptr[-1])
        # FlashInfer reads clamp(pages - 1, 0) + last_page_len keys: a segment listing no key
        # must say 0, or it reads one key past its end (torch_models.keys_read).
        last_page_len = (kv_indptr.diff() > 0).to(torch.int32)
        self.wrapper.plan(
            _host(qo_indptr, dev), _host(kv_indptr, dev), kv_indices, _host(last_page_len, dev),
            num_qo_heads, num_kv_heads, head_dim, 1,
            causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=kv_dtype, o_data_type=dtype)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n_qo, H, d]; k_cache/v_cache [n_slots, Hkv, d] (the layer's pool) -> [n_qo, H, dv]."""
        if q.shape[0] != self.n_qo:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {self.n_qo}")
        # [n_slots, page_size=1, Hkv, d]: the pool as FlashInfer's NHD paged cache.
        out = self.wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))
        if self.new_event is not None:
            self.last_run = self.new_event()
            self.last_run.record()
        return out


class _WrapperRing:
    """At most ``size`` paged-prefill wrappers sharing one float workspace, used in turn (module doc)."""

    def __init__(self, device: torch.device | str, workspace_bytes: int, size: int = RING_SIZE) -> None:
        self.flashinfer = import_flashinfer()
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.size = size
        self.calls: list[_PagedPrefillCall] = []
        self.turn = 0
        # the event recorded after each run: CUDA's on a CUDA pool (nothing runs ahead elsewhere)
        self.new_event: Optional[Callable[[], Any]] = torch.cuda.Event if self.device.type == "cuda" else None

    def next_call(self) -> _PagedPrefillCall:
        """The next wrapper of the ring (its plan waits for its previous run)."""
        i = self.turn % self.size
        self.turn += 1
        if i == len(self.calls):
            self.calls.append(_PagedPrefillCall(self.flashinfer, self.workspace, self.new_event))
        return self.calls[i]


@dataclass
class _AnchorLayer:
    inputs: AnchorLayerInputs
    rows: Optional[torch.Tensor] = None  # device int64 [n_kept] layout rows with keys
    qo: Optional[torch.Tensor] = None  # device int64 [n_kept] their queries in the call


class AnchorForwardPlan:
    """One request's anchors in one pass: every layer's host metadata, built once."""

    def __init__(self, layouts: Sequence[BlockSparseLayout]) -> None:
        self.layouts = list(layouts)
        self.layers = [_AnchorLayer(inputs) for inputs in anchor_prefill_inputs(self.layouts)]


class FlashInferAnchorAttention:
    """Executes the anchors' layouts of a repair pass with FlashInfer (module doc).

    Args:
        device: the CUDA device of the KV pool.
        workspace_bytes: the float workspace shared by the wrappers.
    """

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._ring = _WrapperRing(device, workspace_bytes)
        self.device = self._ring.device

    @staticmethod
    def plan_forward(layouts: Sequence[BlockSparseLayout]) -> AnchorForwardPlan:
        """Every layer's host metadata of one request, in one vectorised pass (no device work)."""
        return AnchorForwardPlan(layouts)

    def run(self, plan: AnchorForwardPlan, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, key_rows: torch.Tensor, scale: float) -> torch.Tensor:
        """Attend one layer's anchors: one plan + one run of a paged prefill.

        Args:
            plan: from :meth:`plan_forward`.
            layer: index into ``plan.layouts``.
            q: [n_rows, H, d] the anchors' queries, in layout row order.
            k_cache, v_cache: [n_slots, Hkv, d] the layer's KV pool.
            key_rows: int64 [>= n_keys] pool slot of each key position (on the pool's device).
            scale: softmax scale.
        Returns:
            [n_rows, H, dv] in q's dtype (0 for a row that sees no key).
        """
        entry = plan.layers[layer]
        inputs = entry.inputs
        if q.shape[0] != inputs.n_rows:
            raise ValueError(f"q has {q.shape[0]} rows, layer {layer}'s layout has {inputs.n_rows}")
        out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
        if inputs.n_segments == 0:
            return out
        if entry.rows is None:
            kept = (inputs.row_to_qo >= 0).nonzero().squeeze(1)  # host
            entry.rows = to_device(kept, q.device)
            entry.qo = to_device(inputs.row_to_qo.index_select(0, kept), q.device)
        call = self._ring.next_call()
        call.plan(inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices(to_device(key_rows, q.device)),
                  num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                  kv_dtype=k_cache.dtype, scale=scale)
        q_call = q.new_zeros(inputs.n_qo, q.shape[1], q.shape[2])  # padding queries stay 0
        q_call.index_copy_(0, entry.qo, q.index_select(0, entry.rows))
        o = call.run(q_call, k_cache, v_cache)
        return out.index_copy_(0, entry.rows, o.index_select(0, entry.qo).to(out.dtype))


class FlashInferScopedPrefill:
    """An extend batch's chunk-scoped rows through one FlashInfer paged prefill (module doc).

    :meth:`plan` once per forward, :meth:`run` at every layer.

    Args:
        device: the CUDA device of the KV pool.
        workspace_bytes: the float workspace.
    """

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self._ring = _WrapperRing(device, workspace_bytes, size=2)
        self._call: Optional[_PagedPrefillCall] = None

    def plan(self, inputs: ScopedPrefillInputs, req_to_token: torch.Tensor, *, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """Plan the batch: inputs from :func:`~.prefill_inputs.scoped_prefill_inputs`, keys read
        through SGLang's ``req_to_token`` [n_req_slots, max_context] (on the device)."""
        # Two wrappers alternate per forward; each plan waits for its wrapper's last run.
        self._call = self._ring.next_call()
        self._call.plan(inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices(req_to_token),
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                        kv_dtype=kv_dtype, scale=scale)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n_rows, H, d] the batch's rows in batch order -> [n_rows, H, dv]."""
        if self._call is None:
            raise RuntimeError("FlashInferScopedPrefill.run before plan")
        return self._call.run(q, k_cache, v_cache)
