"""The ``relaxkv`` attention backend: extend rows at explicit positions and scopes.

SGLang's backends assume a request's extend tokens are the contiguous tail of its sequence. A
batch the fold changed keeps only some rows, each at its own position, and a row of a chunk-cache
miss sees only keys from its *scope start* (the chunk's first position) on; an ordinary row has
scope start 0. :func:`~.attention_paths.attention_path` picks per batch: ``"sglang"`` (decode,
idle, an unchanged extend, every CUDA-graph capture or replay: SGLang's backend as is) or
``"scoped"`` (a folded batch, or one recording the repair's query scores).

:func:`create_backend` picks the class by device, each in its own module imported on first use:
CPU, a ``torch_native`` subclass (:mod:`.torch_native_backend`, scoped batches through
:func:`~relaxkv_sglang.attention.causal.scoped_causal_attention`); CUDA, a FlashInfer subclass
(:mod:`.flashinfer_backend`, scoped batches through
:class:`~relaxkv_sglang.attention.gpu.flashinfer_attention.FlashInferScopedPrefill` and kept off prefill
CUDA graphs; see docs/gpu.md for what has run on a GPU). Both refuse at startup a sliding window,
a logit soft cap or FP8 K/V scales (:func:`~.attention_paths.check_attention_settings`). This
module imports no SGLang.
"""

from __future__ import annotations

from typing import Any


def create_backend(model_runner: Any) -> Any:
    """The ``relaxkv`` backend for a model runner: FlashInfer-composed on CUDA, torch elsewhere."""
    if str(model_runner.device).split(":")[0] == "cuda":
        return build_cuda_backend_class()(model_runner)
    return build_backend_class()(model_runner)


def build_backend_class() -> type:
    """The CPU class (:mod:`relaxkv_sglang.attention.sglang.torch_native_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.attention.sglang.torch_native_backend import RelaxKVAttnBackend

    return RelaxKVAttnBackend


def build_cuda_backend_class() -> type:
    """The CUDA class (:mod:`relaxkv_sglang.attention.sglang.flashinfer_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.attention.sglang.flashinfer_backend import RelaxKVFlashInferBackend

    return RelaxKVFlashInferBackend
