"""One folded forward, top to bottom: :mod:`.pipeline` runs :mod:`.fold` (chunk hits copied, misses
scoped), :mod:`.query_pass` (every request's rows), :mod:`.repair_stage` (anchors, after SGLang's
layers; its budget: :mod:`.budget`), SGLang's forward under :mod:`.context`, and :mod:`.finish`
(misses published, reuse counted, :mod:`.report`). The whole room is SGLang's seam (an adapter).

SGLang files hooked: ``managers/tp_worker.py`` (``forward_batch_generation``),
``model_executor/forward_batch_info.py`` (``ForwardBatch.init_new``),
``managers/scheduler_components/output_streamer.py`` (``is_request_level_customized_info_key``),
each hooked decoder stack's ``forward`` (``model.model_family.hooked_model_classes``).
"""
