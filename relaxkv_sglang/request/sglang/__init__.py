"""The request's SGLang adapter: the HTTP process validates the fields and SGLang's own fields that
would stop its scheduler, turns marks, chat parts or discovered documents into the prompt's
chunk spans and hands the scheduler a :class:`~relaxkv_sglang.request.plan.RequestPlan`
(:mod:`.api`, :mod:`.chat`, :mod:`.parallel_encoding`, :mod:`.join_registry`,
:mod:`.sglang_fields`); in the scheduler, the finish checks SGLang would leave unbounded or
batch-dependent (:mod:`.stop_regex`, :mod:`.prefill_only`).

SGLang files hooked: ``managers/tokenizer_manager.py`` (``generate_request``),
``managers/tokenizer_control_mixin.py`` (``flush_cache``), ``entrypoints/openai/serving_chat.py``
(``_convert_to_internal_request``, ``_generate_stream_content``), ``entrypoints/http_server.py``
(``serve_generate_request``), ``managers/schedule_batch.py`` (its module global ``re``, rebound),
``managers/scheduler_components/logprob_result_processor.py`` (``add_logprob_return_values``).
"""
