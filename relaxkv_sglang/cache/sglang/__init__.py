"""The ``relaxkv`` tree cache in SGLang's scheduler process (:mod:`.tree_cache_class`), called through
:class:`~.relaxkv_cache.RelaxKVCache`. SGLang files used: ``mem_cache/radix_cache.py`` (subclassed),
``mem_cache/memory_pool.py`` (the KV pool), ``mem_cache/storage/`` (HiCache storage backends),
``managers/scheduler.py`` and ``managers/schedule_policy.py`` (admission).
"""
