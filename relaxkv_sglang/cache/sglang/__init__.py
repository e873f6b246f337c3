"""The ``relaxkv`` tree cache in SGLang's scheduler process: SGLang's radix tree plus the chunk
store (:mod:`.tree_cache_class`), its parts one concept each (reuse and publication, every KV copy
in the pool, admission pins and the admission hold, eviction order, the lower tiers and the
movement between them, the model identity, the counters) and the forward's two cache stages,
hits copied in (:mod:`.fold`) and misses published (:mod:`.finish`). The rest of the plugin calls
it through :class:`~.relaxkv_cache.RelaxKVCache`.

SGLang files used: ``mem_cache/radix_cache.py`` (subclassed), ``mem_cache/memory_pool.py`` (the
KV pool), ``mem_cache/storage/`` (HiCache storage backends), ``managers/scheduler.py``
(``get_new_batch_prefill``) and ``managers/schedule_policy.py`` (``PrefillAdder``: admission).
"""
