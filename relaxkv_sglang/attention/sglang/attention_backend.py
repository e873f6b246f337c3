"""The ``relaxkv`` attention backend: extend rows at explicit positions and scopes.

SGLang's backends assume a request's extend tokens are the contiguous tail of its sequence; a folded batch keeps
only some rows, each at its own position, and a chunk-cache miss's row sees keys only from its *scope start* (the
chunk's first position; 0 for an ordinary row) on. :func:`~.attention_paths.attention_path` picks ``"sglang"``
(decode, idle, an unchanged extend, every CUDA-graph capture or replay) or ``"scoped"`` (a folded batch, or one
recording the repair's query scores). The classes (:mod:`.torch_native_backend`, :mod:`.flashinfer_backend`) are
imported on first use; this module imports no SGLang at run time."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.model_runner import ModelRunner


def create_backend(model_runner: ModelRunner) -> AttentionBackend:
    """The ``relaxkv`` backend for a model runner: FlashInfer-composed on CUDA, torch elsewhere."""
    if str(model_runner.device).split(":")[0] == "cuda":
        return build_cuda_backend_class()(model_runner)
    return build_backend_class()(model_runner)


def build_backend_class() -> type:
    """The CPU class (:mod:`.torch_native_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.attention.sglang.torch_native_backend import RelaxKVAttnBackend

    return RelaxKVAttnBackend


def build_cuda_backend_class() -> type:
    """The CUDA class (:mod:`.flashinfer_backend`), imported on first use (it imports SGLang)."""
    from relaxkv_sglang.attention.sglang.flashinfer_backend import RelaxKVFlashInferBackend

    return RelaxKVFlashInferBackend
