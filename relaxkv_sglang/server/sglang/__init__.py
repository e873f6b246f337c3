"""The plugin SGLang loads: registrations and the hook table (:mod:`.plugin`), the startup wiring
(:mod:`.startup`), the startup gate on the loaded model (:mod:`.gate`, asked by the HTTP process:
:mod:`.gate_refusal`), the forward's pipeline (:mod:`.pipeline`).

SGLang files hooked: ``managers/tp_worker.py`` (``forward_batch_generation``),
``model_executor/forward_batch_info.py`` (``ForwardBatch.init_new``),
``managers/scheduler_components/output_streamer.py`` (``is_request_level_customized_info_key``).
"""
