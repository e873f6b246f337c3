"""The scheduler process's request handling around the cache: admission, finish checks, logprobs.

Runs in SGLang's scheduler process, on the scheduler thread: it pins a request's chunk hits from
admission to its fold (through :class:`~relaxkv_sglang.srt.mem_cache.chunk_cache.ChunkCache`),
bounds the time SGLang's stop-regex matching may take, and keeps a prefill-only request's output
logprobs independent of its batch.

SGLang files hooked: ``managers/scheduler.py`` (``Scheduler.get_new_batch_prefill``),
``managers/schedule_policy.py`` (``PrefillAdder.add_one_req``, ``add_chunked_req``),
``managers/schedule_batch.py`` (``Req._check_str_based_finish``),
``managers/scheduler_components/logprob_result_processor.py``
(``SchedulerLogprobResultProcessor.add_logprob_return_values``).
"""
