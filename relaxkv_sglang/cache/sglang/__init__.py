"""The ``relaxkv`` tree cache in SGLang's scheduler process: SGLang's radix tree plus the chunk
store (:mod:`.tree_cache_class`) and the forward's cache stages (:mod:`.fold`, :mod:`.finish`);
the rest of the plugin calls it through :class:`~.relaxkv_cache.RelaxKVCache`.

SGLang files used: ``mem_cache/radix_cache.py`` (subclassed), ``mem_cache/memory_pool.py`` (the
KV pool), ``mem_cache/storage/`` (HiCache storage backends), ``managers/scheduler.py``
(``get_new_batch_prefill``) and ``managers/schedule_policy.py`` (``PrefillAdder``: admission).
"""
