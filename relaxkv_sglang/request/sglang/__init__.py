"""The request's SGLang adapter. HTTP process: the fields and SGLang's own fields that would stop its
scheduler checked, marks, chat parts or discovered documents turned into chunk spans, a
:class:`~relaxkv_sglang.request.plan.RequestPlan` handed on (:mod:`.api`, :mod:`.chat`,
:mod:`.parallel_encoding`, :mod:`.join_registry`, :mod:`.sglang_fields`). Scheduler: the finish checks
SGLang would leave unbounded or batch-dependent (:mod:`.stop_regex`, :mod:`.prefill_only`).

SGLang files hooked: ``managers/tokenizer_manager.py``, ``managers/tokenizer_control_mixin.py``,
``entrypoints/openai/serving_chat.py``, ``entrypoints/http_server.py``, ``managers/schedule_batch.py``,
``managers/scheduler_components/logprob_result_processor.py`` (each module names its functions).
"""
