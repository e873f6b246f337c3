"""The plugin's attention on a GPU through FlashInfer's paged prefill: the thin layer.

Every decision is made in torch and shared with the CPU path; :mod:`.anchor_inputs` and
:mod:`.prefill_inputs` turn it into one ``BatchPrefillWithPagedKVCacheWrapper`` call (page size 1 over
SGLang's KV pool, no gather; ``causal=True``, ``backend="fa2"`` as SGLang's FlashInfer backend).
No host syncs of our own: indptrs in one page-locked buffer, device indices on the pass's stage.
``plan`` copies its schedule asynchronously from the wrapper's pinned buffer, so wrappers form a ring
(8 MiB device + 8 MiB pinned each) and a plan waits on the event its wrapper's previous plan recorded
(counted ``host_waits``). The float workspace is SGLang's on a server (nothing its KV pool sizing did
not count). Pinned to flashinfer-python 0.7.2 (sglang 0.5.23's); torch model of the call:
:func:`~.torch_models.paged_prefill_attention`.
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
RING_SIZE = 4

__all__ = ["FLASHINFER_VERSION", "FlashInferAnchorAttention", "FlashInferScopedPrefill", "import_flashinfer"]


def import_flashinfer():
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
    """One wrapper (NHD, page size 1, causal) and its plan; ``new_event`` None off CUDA."""

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
        """qo_indptr, kv_indptr int32 host [n_seg + 1], last_page_len int32 host [n_seg] (page-locked on
        CUDA: FlashInfer copies them without blocking); kv_indices int32 [n_kv] pool slots on the device."""
        if self.staged is not None:
            # The previous plan's copy from the pinned buffer must have run (the device side: stream order).
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
        """q [n_qo, H, d]; k_cache, v_cache [n_slots, Hkv, d] (the layer's pool) -> [n_qo, H, dv]."""
        if q.shape[0] != self.n_qo:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {self.n_qo}")
        return self.wrapper.run(q, (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))


class _WrapperRing:
    """At most ``size`` wrappers sharing one float workspace, used in turn (module doc)."""

    def __init__(self, device: torch.device | str, workspace_bytes: int, size: int = RING_SIZE,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self.flashinfer = import_flashinfer()
        self.device = torch.device(device)
        self.workspace = (float_workspace if float_workspace is not None
                          else torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device))
        self.size = size
        self.calls: list[_PagedPrefillCall] = []
        self.turn = 0
        self.new_event: Optional[Callable[[], Any]] = ((lambda: torch.cuda.Event()) if self.device.type == "cuda"
                                                       else None)

    def next_call(self) -> _PagedPrefillCall:
        i = self.turn % self.size
        self.turn += 1
        if i == len(self.calls):
            self.calls.append(_PagedPrefillCall(self.flashinfer, self.workspace, self.new_event))
        return self.calls[i]

    @property
    def host_waits(self) -> int:
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
    """One request's pass: every layer's host metadata in one page-locked buffer; device indices on ``stage``."""

    def __init__(self, layouts: Sequence[BlockSparseLayout], stage: HostStage) -> None:
        self.layouts = list(layouts)
        inputs = anchor_prefill_inputs(self.layouts)
        host = pinned_host([t for i in inputs for t in (i.qo_indptr, i.kv_indptr, i.last_page_len)], stage.device)
        self.layers = []
        for j, i in enumerate(inputs):
            kept = (i.row_to_qo >= 0).nonzero().squeeze(1)
            self.layers.append(_AnchorLayer(i, *host[3 * j:3 * j + 3], stage.put(kept), stage.put(i.row_to_qo[kept]),
                                            stage.put(i.run_start), stage.put(i.run_len)))


class FlashInferAnchorAttention:
    """A repair pass's anchor layouts: host metadata once per request and pass, one plan and run per layer;
    ``workspace_bytes`` allocated without ``float_workspace``."""

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self._ring = _WrapperRing(device, workspace_bytes, float_workspace=float_workspace)
        self.device = self._ring.device

    @property
    def host_waits(self) -> int:
        return self._ring.host_waits

    def pass_metadata(self, layouts: Sequence[BlockSparseLayout],
                      stage: Optional[HostStage] = None) -> AnchorPassMetadata:
        """``stage``: the caller sends it before the first run (None: one of its own, sent here)."""
        if stage is not None:
            return AnchorPassMetadata(layouts, stage)
        stage = HostStage(self.device)
        metadata = AnchorPassMetadata(layouts, stage)
        stage.send()
        return metadata

    def run(self, metadata: AnchorPassMetadata, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, key_rows: torch.Tensor, scale: float) -> torch.Tensor:
        """q [n_rows, H, d] in layout row order; k_cache, v_cache [n_slots, Hkv, d]; key_rows int64
        [>= n_keys] pool slots on the pool's device -> [n_rows, H, dv] in q's dtype (0: sees no key)."""
        entry = metadata.layers[layer]
        inputs = entry.inputs
        if q.shape[0] != inputs.n_rows:
            raise ValueError(f"q has {q.shape[0]} rows, layer {layer}'s layout has {inputs.n_rows}")
        out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
        if inputs.n_segments == 0:
            return out
        call = self._ring.next_call()
        kv_indices = inputs.kv_indices(key_rows, entry.run_start.get(), entry.run_len.get())
        call.plan(entry.qo_indptr, entry.kv_indptr, entry.last_page_len, kv_indices,
                  num_qo_heads=q.shape[1], num_kv_heads=k_cache.shape[1], head_dim=q.shape[2], dtype=q.dtype,
                  kv_dtype=k_cache.dtype, scale=scale)
        q_call = q.new_zeros(inputs.n_qo, q.shape[1], q.shape[2])  # padding queries stay 0
        rows, qo = entry.rows.get(), entry.qo.get()
        q_call.index_copy_(0, qo, q.index_select(0, rows))
        o = call.run(q_call, k_cache, v_cache)
        return out.index_copy_(0, rows, o.index_select(0, qo).to(out.dtype))


class FlashInferScopedPrefill:
    """An extend batch's chunk-scoped rows: :meth:`plan` once per forward, :meth:`run` at every layer."""

    def __init__(self, device: torch.device | str, workspace_bytes: int = WORKSPACE_BYTES,
                 float_workspace: Optional[torch.Tensor] = None) -> None:
        self._ring = _WrapperRing(device, workspace_bytes, size=2, float_workspace=float_workspace)
        self._call: Optional[_PagedPrefillCall] = None

    def plan(self, inputs: ScopedPrefillInputs, req_to_token: torch.Tensor, *, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """``inputs``: :func:`~.prefill_inputs.scoped_prefill_inputs`; keys through SGLang's ``req_to_token``
        [n_req_slots, max_context] on the device."""
        self._call = self._ring.next_call()
        qo_indptr, kv_indptr, last_page_len = pinned_host([inputs.qo_indptr, inputs.kv_indptr, inputs.last_page_len],
                                                          req_to_token.device)
        self._call.plan(qo_indptr, kv_indptr, last_page_len, inputs.kv_indices(req_to_token),
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                        kv_dtype=kv_dtype, scale=scale)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [n_rows, H, d] in batch order -> [n_rows, H, dv]."""
        if self._call is None:
            raise RuntimeError("FlashInferScopedPrefill.run before plan")
        return self._call.run(q, k_cache, v_cache)
