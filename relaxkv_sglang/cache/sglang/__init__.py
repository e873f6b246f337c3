"""The ``relaxkv`` tree cache in SGLang's scheduler process: SGLang's radix tree plus the pool's
chunk index (:mod:`.tree_cache_class`); the rest of the plugin (the forward's stages,
:mod:`relaxkv_sglang.forward`, and admission) calls it through :class:`~.relaxkv_cache.RelaxKVCache`.

SGLang files used: ``mem_cache/radix_cache.py`` (subclassed), ``mem_cache/memory_pool.py`` (the
KV pool), ``mem_cache/storage/`` (HiCache storage backends), ``managers/scheduler.py``
(``get_new_batch_prefill``) and ``managers/schedule_policy.py`` (``PrefillAdder``: admission).
"""
