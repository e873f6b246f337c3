"""The HTTP process: what the plugin does to a request before SGLang's scheduler sees it.

Runs in SGLang's HTTP server process (FastAPI app, ``TokenizerManager``, the OpenAI serving
classes). It validates the ``relaxkv_*`` fields and SGLang's own fields that would kill the
scheduler, turns marks, chat parts or discovered documents into chunk spans of the prompt's own
tokenization, and plans parallel-encoding requests (:mod:`relaxkv_sglang.srt.plan` carries the
result to the scheduler).

SGLang files hooked: ``managers/tokenizer_manager.py`` (``TokenizerManager.generate_request``),
``managers/tokenizer_control_mixin.py`` (``flush_cache``), ``entrypoints/openai/serving_chat.py``
(``OpenAIServingChat._convert_to_internal_request``), ``entrypoints/http_server.py``
(``serve_generate_request``). Imports nothing of the scheduler's packages.
"""
