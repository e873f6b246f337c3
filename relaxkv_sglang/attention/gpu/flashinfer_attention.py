"""The plugin's attention on a GPU through FlashInfer's paged prefill: the thin layer.

Every decision is made in torch and shared with the CPU path (the core's layouts, the fold's
``ExtendRows``); :mod:`.anchor_inputs` and :mod:`.prefill_inputs` turn them into segments of one
``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` call (page size 1 over SGLang's KV pool, no
gather; ``causal=True``, ``backend="fa2"`` as SGLang's FlashInfer backend). This module plans and runs:

* :class:`FlashInferAnchorAttention` (the repair's anchors): every layer's host metadata built once
  per request and pass, then per layer one ``plan`` (host indptrs; keys expanded on the device) and
  one ``run``;
* :class:`FlashInferScopedPrefill` (an extend batch the fold changed): one ``plan`` per forward, one
  ``run`` per layer.

No host syncs of our own: indptrs are computed on the host in one page-locked buffer per forward;
device indices arrive on the pass's stage (:mod:`relaxkv_sglang.attention.staging`). ``plan`` copies its
schedule asynchronously from the wrapper's pinned buffer, so wrappers form a ring of ``RING_SIZE``
(8 MiB device + 8 MiB pinned each) and a wrapper's next plan waits on the CUDA event its previous
plan recorded (a host wait, counted ``host_waits``). The float workspace is SGLang's on a server
(``WORKSPACE_BYTES`` allocated here otherwise).

Pinned to flashinfer-python 0.7.2 (sglang 0.5.23's); another version is refused at construction.
Torch model of the call: :func:`~.torch_models.paged_prefill_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from relaxkv_sglang.attention.layout import BlockSparseLayout
from relaxkv_sglang.attention.staging import HostStage, Staged, pinned_host
from relaxkv_sglang.attention.gpu.anchor_inputs import AnchorLayerInputs, anchor_prefill_inputs
from relaxkv_sglang.attention.gpu.prefill_inputs import ScopedPrefillInputs

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
                           f"for {FLASHINFER_VERSION} (relaxkv_sglang/attention/gpu/flashinfer_attention.py)")
    return flashinfer


class _PagedPrefillCall:
    """One FlashInfer paged-prefill wrapper (NHD, page size 1, causal) and its current plan.

    ``new_event``: makes the event recorded after each plan (CUDA); None on other devices."""

    def __init__(self, flashinfer: Any, float_workspace: torch.Tensor,
                 new_event: Optional[Callable[[], Any]] = None) -> None:
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(float_workspace, "NHD", backend="fa2")
        self.n_qo = -1
        self.kv_indices: Optional[torch.Tensor] = None  # kept alive until the run
        self.new_event = new_event
        self.staged: Any = None  # the event after the last plan's staged copy, until the next plan
        self.host_waits = 0

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, last_page_len: torch.Tensor,
             kv_indices: torch.Tensor, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             kv_dtype: torch.dtype, scale: float) -> None:
        """qo_indptr/kv_indptr: int32 host [n_seg + 1]; last_page_len: int32 host [n_seg] (page-locked
        on CUDA: FlashInfer copies them itself, without blocking); kv_indices: int32 [n_kv] pool
        slots on the device; dtype/kv_dtype: of q and of the KV pool."""
        if self.staged is not None:
            # FlashInfer writes its schedule into the wrapper's page-locked buffer and copies it to
            # the device asynchronously: the previous plan's copy must have run first. (The device
            # buffer it lands in is safe by stream order: this plan's copy follows the last run.)
            if not self.staged.query():
                self.staged.synchronize()  # a host wait: the CPU is a ring's worth of plans ahead
                self.host_waits += 1
            self.staged = None
        self.kv_indices = kv_indices
        self.n_qo = int(qo_indptr[-1])
        self.wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, 1,
            causal=True, sm_scale=scale, q_data_type=dtype, kv_data_type=kv_dtype, o_data_type=dtype)
        if self.new_event is not None:
            self.staged = self.new_event()
            self.staged.record()

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n_qo, H, d]; k_cache/v_cache [n_slots, Hkv, d] (the layer's pool) -> [n_qo, H, dv]."""
        if q.shape[0] != self.n_qo:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {self.n_qo}")
        # [n_slots, page_size=1, Hkv, d]: the pool as FlashInfer's NHD paged cache.
        return self.wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))


class _WrapperRing:
    """At most ``size`` paged-prefill wrappers sharing one float workspace, used in turn (module doc)."""

    def __init__(self, device: torch.device | str, workspace_bytes: int, size: int = RING_SIZE,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self.flashinfer = import_flashinfer()
        self.device = torch.device(device)
        # SGLang's own when given (module doc: nothing the KV pool's sizing did not count)
        self.workspace = (float_workspace if float_workspace is not None
                          else torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device))
        self.size = size
        self.calls: list[_PagedPrefillCall] = []
        self.turn = 0
        # the event recorded after each plan: CUDA's on a CUDA pool (nothing runs ahead elsewhere)
        self.new_event: Optional[Callable[[], Any]] = (lambda: torch.cuda.Event()) if self.device.type == "cuda" else None

    def next_call(self) -> _PagedPrefillCall:
        """The next wrapper of the ring (its plan waits for its previous plan's staged copy)."""
        i = self.turn % self.size
        self.turn += 1
        if i == len(self.calls):
            self.calls.append(_PagedPrefillCall(self.flashinfer, self.workspace, self.new_event))
        return self.calls[i]

    @property
    def host_waits(self) -> int:
        """Plans that waited on the host for their wrapper's previous staged copy."""
        return sum(c.host_waits for c in self.calls)


@dataclass
class _AnchorLayer:
    """One layer's call: host metadata (page-locked views on CUDA) and the staged device indices."""

    inputs: AnchorLayerInputs
    qo_indptr: torch.Tensor  # int32 host [n_seg + 1]
    kv_indptr: torch.Tensor  # int32 host [n_seg + 1]
    last_page_len: torch.Tensor  # int32 host [n_seg]
    rows: Staged  # int64 [n_kept] layout rows with keys
    qo: Staged  # int64 [n_kept] their queries in the call
    run_start: Staged  # the call's key runs (AnchorLayerInputs)
    run_len: Staged


class AnchorPassMetadata:
    """One request's anchors in one pass: every layer's host metadata, built once, in one
    page-locked buffer; the device's indices on ``stage``."""

    def __init__(self, layouts: Sequence[BlockSparseLayout], stage: HostStage) -> None:
        self.layouts = list(layouts)
        inputs = anchor_prefill_inputs(self.layouts)
        host = pinned_host([t for i in inputs for t in (i.qo_indptr, i.kv_indptr, i.last_page_len)], stage.device)
        self.layers = []
        for j, i in enumerate(inputs):
            kept = (i.row_to_qo >= 0).nonzero().squeeze(1)  # host
            self.layers.append(_AnchorLayer(i, *host[3 * j:3 * j + 3], stage.put(kept), stage.put(i.row_to_qo[kept]),
                                            stage.put(i.run_start), stage.put(i.run_len)))


class FlashInferAnchorAttention:
    """Executes the anchors' layouts of a repair pass with FlashInfer (module doc).

    Args:
        device: the CUDA device of the KV pool.
        workspace_bytes: the float workspace shared by the wrappers, allocated here when
            ``float_workspace`` (e.g. SGLang's FlashInfer backend's) is not given.
    """

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self._ring = _WrapperRing(device, workspace_bytes, float_workspace=float_workspace)
        self.device = self._ring.device

    @property
    def host_waits(self) -> int:
        """Plans that waited on the host for a wrapper of the ring (module doc)."""
        return self._ring.host_waits

    def pass_metadata(self, layouts: Sequence[BlockSparseLayout], stage: Optional[HostStage] = None) -> AnchorPassMetadata:
        """Every layer's metadata of one request, in one vectorised pass; its device indices on
        ``stage`` (the caller sends it before the first run; None: a stage of its own, sent here)."""
        if stage is not None:
            return AnchorPassMetadata(layouts, stage)
        stage = HostStage(self.device)
        plan = AnchorPassMetadata(layouts, stage)
        stage.send()
        return plan

    def run(self, plan: AnchorPassMetadata, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, key_rows: torch.Tensor, scale: float) -> torch.Tensor:
        """Attend one layer's anchors: one plan + one run of a paged prefill.

        Args:
            plan: from :meth:`pass_metadata`.
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
        call = self._ring.next_call()
        kv_indices = inputs.kv_indices(key_rows, entry.run_start.get(), entry.run_len.get())  # staged runs
        call.plan(entry.qo_indptr, entry.kv_indptr, entry.last_page_len, kv_indices,
                  num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                  kv_dtype=k_cache.dtype, scale=scale)
        q_call = q.new_zeros(inputs.n_qo, q.shape[1], q.shape[2])  # padding queries stay 0
        rows, qo = entry.rows.get(), entry.qo.get()
        q_call.index_copy_(0, qo, q.index_select(0, rows))
        o = call.run(q_call, k_cache, v_cache)
        return out.index_copy_(0, rows, o.index_select(0, qo).to(out.dtype))


class FlashInferScopedPrefill:
    """An extend batch's chunk-scoped rows through one FlashInfer paged prefill (module doc).

    :meth:`plan` once per forward, :meth:`run` at every layer.

    Args:
        device: the CUDA device of the KV pool.
        workspace_bytes, float_workspace: as :class:`FlashInferAnchorAttention`'s.
    """

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self._ring = _WrapperRing(device, workspace_bytes, size=2, float_workspace=float_workspace)
        self._call: Optional[_PagedPrefillCall] = None

    def plan(self, inputs: ScopedPrefillInputs, req_to_token: torch.Tensor, *, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """Plan the batch: inputs from :func:`~.prefill_inputs.scoped_prefill_inputs`, keys read
        through SGLang's ``req_to_token`` [n_req_slots, max_context] (on the device). One staged
        copy and one page-locked buffer per forward."""
        # Two wrappers alternate per forward; each plan waits for its wrapper's last staged copy.
        self._call = self._ring.next_call()
        qo_indptr, kv_indptr, last_page_len = pinned_host([inputs.qo_indptr, inputs.kv_indptr, inputs.last_page_len],
                                                          req_to_token.device)
        self._call.plan(qo_indptr, kv_indptr, last_page_len, inputs.kv_indices(req_to_token),
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                        kv_dtype=kv_dtype, scale=scale)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n_rows, H, d] the batch's rows in batch order -> [n_rows, H, dv]."""
        if self._call is None:
            raise RuntimeError("FlashInferScopedPrefill.run before plan")
        return self._call.run(q, k_cache, v_cache)
