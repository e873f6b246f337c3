"""The forward: a batch's fold, query pass, repair and finish, and the attention they run on.

Runs in SGLang's scheduler process, in the TP worker's forward (:mod:`.pipeline` is the
pipeline of one-way stages: :mod:`.fold` → :mod:`.query_pass` → :mod:`.repair` →
:mod:`.finish`, with :mod:`.report`); the repair's layer loop (:mod:`.layer_loop`) runs SGLang's
model modules (:mod:`.model_layers`); the ``relaxkv`` attention backend (:mod:`.attention_backend`)
attends the rows the fold keeps. It reaches the cache only through
:class:`~relaxkv_sglang.srt.mem_cache.chunk_cache.ChunkCache`.

SGLang files hooked: ``managers/tp_worker.py`` (``TpModelWorker.forward_batch_generation``),
``model_executor/forward_batch_info.py`` (``ForwardBatch.init_new``), each hooked decoder stack's
``forward`` (``models/llama.py``, ``qwen2.py``, ``qwen3.py``, ``qwen2_moe.py``, ``mixtral.py``:
``core.model_family.hooked_model_classes``), ``managers/scheduler_components/output_streamer.py``
(``is_request_level_customized_info_key``); subclassed: ``layers/attention/torch_native_backend.py``,
``layers/attention/flashinfer_backend.py``. Imports nothing of ``entrypoints`` or ``scheduler``.
"""
