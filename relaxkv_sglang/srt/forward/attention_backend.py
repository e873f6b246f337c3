"""The ``relaxkv`` attention backend: extend rows at explicit positions and scopes.

SGLang's backends assume each request's extend tokens are the contiguous tail of its sequence.
A batch the fold changed breaks that: it keeps only some rows, each at its own position, and a
row of a chunk computed position-independently (a chunk-cache miss) may see only keys from its
*scope start* on:

* an ordinary extend row: scope start 0, keys ``[0, position]``;
* a row of a chunk-cache miss: scope start = the chunk's first position, so the chunk attends
  only to itself.

Which rows a folded batch carries comes from :mod:`relaxkv_sglang.srt.forward.pipeline` (through
:func:`~relaxkv_sglang.srt.forward.context.forward_context`). :func:`~relaxkv_sglang.srt.forward.attention_paths.attention_path` decides, per batch,
who attends (a pure function, unit-tested on fake batch descriptions):

* ``"sglang"``: decode, idle, ordinary extend (no fold context, or a fold that left every
  request's contiguous tail unchanged) and every CUDA-graph capture or replay: SGLang's own
  backend, unchanged;
* ``"scoped"``: an extend batch the fold changed, or one whose repair query pass records the
  query's scores: the plugin's scoped attention. (A repair's anchors never reach the backend:
  the model hook runs them in :mod:`relaxkv_sglang.srt.forward.layer_loop` after SGLang's layers.)

Two classes, chosen by :func:`create_backend` from the model runner's device:

* CPU (:mod:`relaxkv_sglang.srt.forward.torch_native_backend`): a subclass of ``torch_native``; ``"scoped"`` batches attend
  through :func:`~relaxkv_sglang.core.attention.scoped_causal_attention` (every extend batch goes
  there, as before: the torch path is unchanged), decode is ``torch_native``'s.
* CUDA (:mod:`relaxkv_sglang.srt.forward.flashinfer_backend`): SGLang's FlashInfer backend (a subclass, so its
  decode, extend, CUDA-graph state and capture hooks are its own, untouched); only ``"scoped"``
  batches take :class:`~relaxkv_sglang.gpu.flashinfer_attention.FlashInferScopedPrefill` (one
  FlashInfer paged prefill per layer, each chunk its own causal segment, planned once per
  forward), and such batches, and any whose context carries a repair, are kept off prefill CUDA
  graphs (:func:`~relaxkv_sglang.srt.forward.attention_paths.may_replay_graph`).
  **Not yet run on a GPU** (docs/gpu.md).

Both refuse at startup a model whose attention layers use a setting the plugin's attention does not
apply (a sliding window, a logit soft cap, FP8 K/V scales: :func:`~relaxkv_sglang.srt.forward.attention_paths.check_attention_settings`).

Each class lives in its own module, imported on first use (as the tree cache class is): this one
imports no SGLang.
"""

from __future__ import annotations

from typing import Any


def create_backend(model_runner: Any) -> Any:
    """The ``relaxkv`` backend for a model runner: FlashInfer-composed on CUDA, torch elsewhere."""
    if str(model_runner.device).split(":")[0] == "cuda":
        return build_cuda_backend_class()(model_runner)
    return build_backend_class()(model_runner)


def build_backend_class() -> type:
    """The CPU class (:mod:`relaxkv_sglang.srt.forward.torch_native_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.srt.forward.torch_native_backend import RelaxKVAttnBackend

    return RelaxKVAttnBackend


def build_cuda_backend_class() -> type:
    """The CUDA class (:mod:`relaxkv_sglang.srt.forward.flashinfer_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.srt.forward.flashinfer_backend import RelaxKVFlashInferBackend

    return RelaxKVFlashInferBackend
